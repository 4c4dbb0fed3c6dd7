"""Images through `ling-serve` on a tiny VL checkpoint (tests/support/vl_checkpoint.py, plus a byte-level
tokenizer.json with the demo's chat template and a small pixel budget), started on 127.0.0.1 with
--allowed-local-media-path and driven with the official `openai` client: a data: URL image's greedy reply equals
`generate.py --chat --image` for the same text and image (the docs example), two different images decoded in one
batch each equal their own, a local file in the allowed directory equals the same image inline, and local files
outside it (or without the flag) and http URLs are refused with a 400 naming the part."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from doc_blocks import blocks
from helpers import ONE_DEVICE_XLA_FLAGS, REPO_ROOT
from optional_deps import require_serve_extra

require_serve_extra()
httpx = pytest.importorskip("httpx", reason="the server tests' client (the test extra)")
openai = pytest.importorskip("openai", reason="the server tests' client (the test extra)")
Image = pytest.importorskip("PIL.Image", reason="the VL extra")

from vl_checkpoint import write_byte_tokenizer, write_text_checkpoint, write_vl_checkpoint  # noqa: E402

from ling_jax import load_model_config  # noqa: E402
from ling_jax.generation.cli import main as generate_main  # noqa: E402
from ling_jax.serving.cli import main as serve_main  # noqa: E402
from ling_jax.serving.media import MediaReader  # noqa: E402
from ling_jax.serving.schemas import APIError  # noqa: E402

MODEL, CHUNK, MAX_CONTEXT, MAX_TOKENS = "Ling-3.0-flash-VL", 16, 128, 12
QUESTION = "What is in the picture?"
START_TIMEOUT_S, REQUEST_TIMEOUT_S = 300, 120
DOC_URL, DOC_IMAGE = "http://127.0.0.1:8000", "cat.png"  # the docs example's


@pytest.fixture(scope="module")
def root(tmp_path_factory, demo_tokenizer):
    """The checkpoint (vl/) and the images (images/: a PNG of 4 x 6 patches and a JPEG of 6 x 6)."""
    root = tmp_path_factory.mktemp("vl-serve")
    write_text_checkpoint(str(root / "text"))
    write_vl_checkpoint(str(root / "text"), str(root / "vl"))
    write_byte_tokenizer(str(root / "vl"), demo_tokenizer.chat_template)
    (root / "vl" / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 64, "max_pixels": 1024}))
    (root / "images").mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(root / "images" / "cat.png")
    Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(root / "images" / "dog.jpg")
    return root


@pytest.fixture(scope="module")
def server(root):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ling_jax.serving", "--model", str(root / "vl"), "--port", str(port)]
    command += ["--served-model-name", MODEL, "--max-batch", "4", "--max-context", str(MAX_CONTEXT)]
    command += ["--prefill-chunk", str(CHUNK), "--allowed-local-media-path", str(root / "images")]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XLA_FLAGS": ONE_DEVICE_XLA_FLAGS}  # faster-compiling emitters
    log = root / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    process.url, process.log = f"http://127.0.0.1:{port}", log
    yield process
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def references(server, root):
    """generate.py --chat --image's greedy completion of QUESTION for each image, and --chat's without one (run
    while the server starts)."""
    found = {}
    for name in ("cat.png", "dog.jpg", None):  # None: the question alone
        argv = ["--model", str(root / "vl"), "--chat", "--temperature", "0", "--max-new-tokens", str(MAX_TOKENS)]
        argv += ["--prefill-chunk", str(CHUNK), "--json", QUESTION]
        argv += [] if name is None else ["--image", str(root / "images" / name)]
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert generate_main(argv) == 0
        found[name] = json.loads(out.getvalue())
    return found


@pytest.fixture(scope="module")
def client(server, references):
    deadline = time.monotonic() + START_TIMEOUT_S
    while server.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"ling-serve did not start (exit {server.poll()}):\n{server.log.read_text()[-3000:]}")


def _data_url(path) -> str:
    kind = "png" if path.suffix == ".png" else "jpeg"
    return f"data:image/{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def _png_url(height: int, width: int) -> str:
    """A grey PNG of height x width pixels as a data: URL."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _ask(client, url: str, **kwargs):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0, **kwargs
    )


def _streamed(client, url: str) -> tuple[str, int]:
    chunks = list(_ask(client, url, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.completion_tokens


def test_the_docs_example_equals_generate_with_the_image(client, root, references, capsys):
    """docs/serving.md's example (a PNG as a data: URL), pointed at this server: generate.py's completion."""
    page = (REPO_ROOT / "docs" / "serving.md").read_text()
    example = next(b.code for b in blocks(page, "docs/serving.md") if b.lang == "python" and "image_url" in b.code)
    example = example.replace(DOC_URL, client.base_url.scheme + "://" + client.base_url.netloc.decode())
    exec(example.replace(DOC_IMAGE, str(root / "images" / "cat.png")), {"__name__": "docs_example"})
    assert capsys.readouterr().out == references["cat.png"]["completion"] + "\n"


def test_two_images_in_one_batch_each_equal_their_own(client, root, references):
    """A PNG (whole reply), a JPEG (streamed) and the question without an image at once: decoded together, each is
    its own completion."""
    cat, dog = (_data_url(root / "images" / name) for name in ("cat.png", "dog.jpg"))
    text_only = [{"role": "user", "content": QUESTION}]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        whole = pool.submit(_ask, client, cat)
        streamed = pool.submit(_streamed, client, dog)
        text = pool.submit(
            client.chat.completions.create, model=MODEL, messages=text_only, max_tokens=MAX_TOKENS, temperature=0
        )
        reply, (dog_text, dog_tokens) = whole.result(), streamed.result()
    assert text.result().choices[0].message.content == references[None]["completion"]
    assert (reply.choices[0].message.content, reply.usage.completion_tokens) == (
        references["cat.png"]["completion"],
        references["cat.png"]["completion_tokens"],
    )
    assert (dog_text, dog_tokens) == (references["dog.jpg"]["completion"], references["dog.jpg"]["completion_tokens"])
    assert references["cat.png"]["completion_ids"] != references["dog.jpg"]["completion_ids"]


def test_a_local_file_in_the_allowed_directory_equals_it_inline(client, root, references):
    for url in ((root / "images" / "cat.png").as_uri(), "cat.png"):  # a file:// URL; a path relative to the directory
        assert _ask(client, url).choices[0].message.content == references["cat.png"]["completion"]


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "never fetches media from the network"),
        ("/etc/hostname", "is outside --allowed-local-media-path"),
        ("../text/config.json", "is outside --allowed-local-media-path"),
        ("missing.png", "no such file"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not an image Pillow can read"),
        (_png_url(1, 250), "the aspect ratio must be below 200"),
    ],
)
def test_refused_urls_are_a_400_naming_the_part(client, url, message):
    with pytest.raises(openai.BadRequestError) as error:
        _ask(client, url)
    body = error.value.body
    assert body["param"] == "messages" and body["message"].startswith("messages.0.content.0.image_url.url: ")
    assert message in body["message"]


def test_n_choices_with_images_are_a_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as error:
        _ask(client, _png_url(8, 8), n=2)
    assert error.value.body["param"] == "n"


def test_local_files_need_the_flag(root):
    """Without --allowed-local-media-path (the reader the server builds then) a path or file:// URL is refused."""
    reader = MediaReader.for_checkpoint(root / "vl", load_model_config(root / "vl"), None)
    for url in (str(root / "images" / "cat.png"), (root / "images" / "cat.png").as_uri()):
        with pytest.raises(APIError, match="local files are refused: start ling-serve with --allowed-local-media-path"):
            reader.image(url, "messages.0.content.0.image_url.url")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--mtp", "1"], "is a VL checkpoint, whose MTP layer is not wired up"),
        (["--allowed-local-media-path", "/nonexistent"], "--allowed-local-media-path /nonexistent: not a directory"),
    ],
)
def test_bad_media_flags_are_one_error_line(root, flags, message, capsys):
    assert serve_main(["--model", str(root / "vl"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1 and message in err


def test_a_text_model_takes_no_local_media_path(root, capsys):
    assert serve_main(["--allowed-local-media-path", str(root / "images")]) == 2
    assert "--allowed-local-media-path: --model" in capsys.readouterr().err
