"""Operations: health, metrics, tracing, logging, the OpenAPI document and error mapping."""
