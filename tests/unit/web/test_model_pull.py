"""`atrium model pull` from a local fake of the Hugging Face hub (never the real one), from a tar
archive over HTTP and from a local folder: the token is sent, the revision pinned, only the files
a model needs are kept, a cut transfer resumes, a wrong checksum is refused, and the folder loads.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants as hf_constants

from engine.model.loader import load_model, load_tokenizer
from engine.model.pull_files import RECORD
from tests.support.fake_hub import FakeHub, FakeRepo, running
from web.cli import main

REPO = "acme/tiny-llama"
TOKEN = "hf_test_not_a_real_token"
COMMIT = "c0ffee" + "0" * 34
EXTRAS = {
    "pytorch_model.bin": b"pickled weights we never load",
    "README.md": b"# a model card",
    "original/consolidated.pth": b"more pickles",
    "onnx/model.onnx": b"onnx graph",
}
TOKENIZER_ONLY = {"config.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture
def model_files(tiny_llama_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in tiny_llama_dir.iterdir() if p.is_file()}


@pytest.fixture
def hub(model_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    repo = FakeRepo({**model_files, **EXTRAS}, commit=COMMIT, branches={"main": COMMIT})
    repo.token = TOKEN
    fake = FakeHub(repos={REPO: repo})
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return fake


def _pull(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    return main(["model", "pull", *argv])


def _kept(dest: Path) -> set[str]:
    return {p.name for p in dest.iterdir() if p.is_file() and p.name != RECORD}


def test_a_hub_pull_sends_the_token_pins_the_revision_and_keeps_only_model_files(
    hub: FakeHub,
    model_files: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "model"
    with running(hub):
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", "main") == 0
    assert COMMIT in capsys.readouterr().out
    assert _kept(dest) == set(model_files)  # no .bin, no README, nothing from subfolders
    for name, data in model_files.items():
        assert (dest / name).read_bytes() == data
    assert all(s.headers.get("authorization") == f"Bearer {TOKEN}" for s in hub.seen)
    # The branch is resolved once; every file is fetched at that commit.
    files = [s.path for s in hub.seen if "/resolve/" in s.path]
    assert files and all(f"/resolve/{COMMIT}/" in path for path in files)
    record = json.loads((dest / RECORD).read_text())
    assert (record["revision"], record["commit"]) == ("main", COMMIT)
    sha = hashlib.sha256(model_files["model.safetensors"]).hexdigest()
    assert record["files"]["model.safetensors"]["sha256"] == sha
    # A second pull of the same revision (a restarted pod) makes no request at all.
    hub.seen.clear()
    with running(hub):
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", "main") == 0
    assert hub.seen == [] and "already there" in capsys.readouterr().out
    # What was pulled is what `atrium serve --model DEST` loads.
    loaded = load_model(str(dest), dtype=torch.float32)
    assert loaded.config.num_layers == 2 and loaded.name == "model"


def test_without_the_token_or_a_revision_nothing_is_pulled(
    hub: FakeHub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "model"
    with running(hub):
        assert _pull(hub, monkeypatch, REPO, str(dest)) == 1
        assert "model_revision_required" in capsys.readouterr().err
        monkeypatch.delenv("HF_TOKEN")
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", "main") == 1
        assert "model_hub_unauthorized" in capsys.readouterr().err
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", "v9") == 1
        assert "model_revision_not_found" in capsys.readouterr().err
    assert not (dest / RECORD).exists()


def test_a_cut_transfer_resumes_and_an_interrupted_pull_keeps_what_it_finished(
    hub: FakeHub,
    model_files: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dest = tmp_path / "model"
    # huggingface_hub writes 10 MiB blocks; the tiny model's weights are 0.4 MiB: smaller blocks,
    # so bytes are written before the cut, as with real shards.
    monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    hub.cut_once.add("model.safetensors")
    hub.failing.add("tokenizer.json")
    with running(hub):
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", COMMIT) == 1
        assert not (dest / RECORD).exists()  # not complete: an engine would not start on it
        # The cut transfer went on from where it stopped, with an HTTP Range.
        ranges = [s.headers.get("range") for s in hub.gets("model.safetensors")]
        assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=")
        assert int(ranges[1].removeprefix("bytes=").rstrip("-")) > 0
        assert (dest / "model.safetensors").read_bytes() == model_files["model.safetensors"]
        hub.failing.clear()
        hub.seen.clear()
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", COMMIT) == 0
    assert hub.gets("model.safetensors") == []  # finished before: not fetched again
    assert len(hub.gets("tokenizer.json")) == 1
    assert _kept(dest) == set(model_files)


def test_bytes_that_differ_from_the_hub_checksum_are_refused_and_deleted(
    hub: FakeHub,
    model_files: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "model"
    good = model_files["model.safetensors"]
    hub.corrupt["model.safetensors"] = bytes([good[0] ^ 1]) + good[1:]  # same size
    with running(hub):
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", COMMIT) == 1
        assert "model_checksum_mismatch" in capsys.readouterr().err
        assert not (dest / "model.safetensors").exists() and not (dest / RECORD).exists()
        hub.corrupt.clear()  # the hub is fixed: a rerun fetches the file anew
        assert _pull(hub, monkeypatch, REPO, str(dest), "--revision", COMMIT) == 0
    assert (dest / "model.safetensors").read_bytes() == good


def test_tokenizer_only_keeps_config_and_tokenizer_files_that_a_gateway_loads(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "tokenizer"
    with running(hub):
        argv = [REPO, str(dest), "--revision", "main", "--tokenizer-only"]
        assert _pull(hub, monkeypatch, *argv) == 0
    assert not [s for s in hub.seen if s.path.endswith(".safetensors")]
    kept = _kept(dest)
    assert kept >= TOKENIZER_ONLY and not [n for n in kept if n.endswith(".safetensors")]
    tokenizer, name = load_tokenizer(str(dest))
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello" and name == "tokenizer"


def _tar(files: dict[str, bytes], top: str = "tiny-llama") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(f"{top}/vocab.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    return buffer.getvalue()


def test_an_archive_over_http_is_resumed_checked_and_unpacked(
    model_files: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    archive = _tar({**model_files, **EXTRAS})
    digest = hashlib.sha256(archive).hexdigest()
    hub = FakeHub(static={"/models/tiny.tar.gz": archive}, cut_once={"/models/tiny.tar.gz"})
    dest = tmp_path / "model"
    with running(hub):
        url = f"{hub.url}/models/tiny.tar.gz"
        assert main(["model", "pull", url, str(dest), "--sha256", "0" * 64]) == 1
        assert "model_checksum_mismatch" in capsys.readouterr().err
        assert main(["model", "pull", url, str(dest), "--sha256", digest]) == 0
    assert [s.headers.get("range") for s in hub.seen if s.method == "GET"][1] is not None
    assert _kept(dest) == set(model_files)  # no link followed, nothing outside the rules
    assert not (dest / ".atrium-pull").exists()  # the fetched archive is gone once unpacked
    assert load_model(str(dest), dtype=torch.float32).config.num_layers == 2


def test_a_local_folder_or_tar_file_is_copied_and_s3_names_its_missing_package(
    tiny_llama_dir: Path,
    model_files: dict[str, bytes],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "copy"
    assert main(["model", "pull", str(tiny_llama_dir), str(dest)]) == 0
    assert _kept(dest) == set(model_files)
    # Onto itself: refused, and the folder's record is kept.
    assert main(["model", "pull", str(dest), str(dest)]) == 1
    assert "model_dest_is_source" in capsys.readouterr().err and (dest / RECORD).exists()
    tokenizer = tmp_path / "tokenizer"
    assert main(["model", "pull", str(dest), str(tokenizer), "--tokenizer-only"]) == 0
    assert _kept(tokenizer) >= TOKENIZER_ONLY and "model.safetensors" not in _kept(tokenizer)
    archive = tmp_path / "tiny.tar.gz"
    archive.write_bytes(_tar(model_files))
    assert main(["model", "pull", str(archive), str(tmp_path / "from-tar")]) == 0
    assert _kept(tmp_path / "from-tar") == set(model_files)
    capsys.readouterr()
    try:
        import s3fs  # noqa: F401

        pytest.skip("s3fs is installed: the missing-package message cannot show")
    except ImportError:
        pass
    assert main(["model", "pull", "s3://bucket/tiny.tar.gz", str(tmp_path / "s3")]) == 1
    err = capsys.readouterr().err
    assert "model_source_needs_package" in err and "s3fs" in err
