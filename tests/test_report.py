"""`flowc inspect MODEL --report DIR` in a real browser: the page is opened in headless
Chromium (Debian's package), which must log no console message (errors, blocked requests:
the page's Content-Security-Policy refuses any request, and Chromium logs each refusal as a
console message), whose DOM must hold an SVG node per node of the collapsed graph and
decoded images, and whose screenshot must not be blank.

Chromium and Graphviz come from `make setup` (the Makefile's apt step); without them the
tests fail, naming what to install.
"""

from __future__ import annotations

import base64
import io
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import SHARED_MODELS, run_cli
from onnx import TensorProto, helper, numpy_helper
from test_models import LIGHT_DIR

from flowc.compiler import load_model
from flowc.ir.graph import Graph
from flowc.options import ModelArgs
from flowc.report.graph import collapse

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
    None,
)
WIDTH, HEIGHT = 1400, 2000

# Chromium writes its own subsystems' complaints to stderr next to the page's console. A
# line `[pid:tid:date:LEVEL:source] text` from one of these sources is not about the page:
NOISE_SOURCES = (
    "dbus/",  # no system D-Bus in a container: bus connections and method calls fail
    "device/bluetooth/",  # BlueZ/Floss over D-Bus, same cause
    "ui/base/idle/",  # no screensaver service on D-Bus
    "media/gpu/",  # VA-API finds no DRM device (--disable-gpu, no GPU at all)
    "sandbox/",  # --no-sandbox (tests run as root) and the GPU process's thread warning
    "mojo/public/cpp/bindings/",  # IPC messages dropped while the headless browser exits
    "gpu/",  # the GPU process falling back to software (--disable-gpu)
    "viz/",  # the compositor without a GPU
    "net/extras/sqlite/",  # the profile's cookie store flushed while the browser exits
)
LOG_LINE = re.compile(r"^\[\d+:\d+:\d+/[\d.]+:(?P<level>[A-Z]+):(?P<source>[^\]]+)\] ")


def need_tools() -> str:
    missing = []
    if CHROMIUM is None:
        missing.append("Chromium (Debian: apt-get install chromium)")
    if shutil.which("dot") is None:
        missing.append("Graphviz dot (Debian: apt-get install graphviz)")
    if missing:
        what = "; ".join(missing) + "; `make setup` installs both"
        # Not a skip: these are set-up's own packages, so missing them is a broken set-up.
        pytest.fail(f"missing {what}")
    assert CHROMIUM is not None
    return CHROMIUM


def page_errors(stderr: str) -> list[str]:
    """The lines of Chromium's stderr that are about the page: every console message (JS
    errors and Content-Security-Policy refusals are logged as source CONSOLE) and every
    warning or error from a source not in NOISE_SOURCES. The one line that is not a log
    line, the Debian launcher script's shell warning ("/usr/bin/chromium: 9: [: ...:
    unexpected operator", a memory check in the wrapper), and --screenshot's "N bytes
    written to file" are left out too."""
    bad = []
    for line in stderr.splitlines():
        m = LOG_LINE.match(line)
        if m is None:
            if (
                line.strip()
                and not re.match(r"^/usr/\S*chrom\S*: \d+: ", line)
                and not re.match(r"^\d+ bytes written to file ", line)
            ):
                bad.append(line)
            continue
        source = m["source"]
        console = source.startswith("CONSOLE")
        unknown = m["level"] in ("WARNING", "ERROR", "FATAL") and not source.startswith(
            NOISE_SOURCES
        )
        if console or unknown:
            bad.append(line)
    return bad


def chromium(browser: str, page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--enable-logging=stderr",
            "--v=0",
            "--hide-scrollbars",
            f"--window-size={WIDTH},{HEIGHT}",
            *args,
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def check_page(page: Path, min_nodes: int, tmp: Path) -> str:
    """Open ``page`` in Chromium and check it; returns the page's text."""
    from PIL import Image

    browser = need_tools()
    text = page.read_text(encoding="utf-8")
    # Self-contained: nothing fetched (namespaces in the SVG are names, not requests).
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:|//)""", text, re.I)
    assert "url(http" not in text and "<link" not in text
    # Every image is a PNG data: URI that decodes.
    uris = re.findall(r'<img[^>]* src="data:image/png;base64,([^"]+)"', text)
    assert len(uris) == len(re.findall(r"<img\b", text)) == 2
    for u in uris:
        im = Image.open(io.BytesIO(base64.b64decode(u)))
        im.load()
        assert im.size[0] > 100 and im.size[1] > 100

    shot = tmp / "shot.png"
    run = chromium(browser, page, f"--screenshot={shot}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert page_errors(run.stderr) == []
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    background = np.array([255, 255, 255])
    share = float(np.mean(np.abs(pixels - background).sum(axis=1) > 30))
    assert share > 0.05, f"only {share:.1%} of the screenshot differs from the background"

    # The DOM, and the images decoded by the browser: a copy of the page whose policy lets
    # one inline script (ours, appended) write each image's decoded size into the DOM.
    probe = tmp / "probe.html"
    probe.write_text(
        text.replace(
            "default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';"
        ).replace(
            "</body>",
            "<script>window.addEventListener('load', () => { for (const im of "
            "document.images) im.setAttribute('data-natural', im.naturalWidth + 'x' + "
            "im.naturalHeight); });</script></body>",
        ),
        encoding="utf-8",
    )
    run = chromium(browser, probe, "--dump-dom", "--virtual-time-budget=2000")
    assert run.returncode == 0, run.stderr[-2000:]
    assert page_errors(run.stderr) == []
    dom = run.stdout
    sizes = re.findall(r'data-natural="(\d+)x(\d+)"', dom)
    assert len(sizes) == 2 and all(int(w) > 100 and int(h) > 100 for w, h in sizes), sizes
    # The SVG as the browser parsed it (the probe adds only the script): a node element per
    # node of the collapsed graph.
    nodes = re.findall(r'<g id="node\d+" class="node\b', dom)
    assert len(nodes) >= min_nodes
    return text


def drawn_nodes(model: Path, *args: str) -> int:
    """Nodes the collapsed graph has: its items plus the graph's inputs and outputs."""
    graph = load_model(ModelArgs(model, dims=tuple(args)))
    return len(collapse(graph)) + len(graph.inputs) + len(graph.outputs)


def test_report_of_bert_tiny_in_chromium(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need_tools()
    model = SHARED_MODELS / "bert_tiny.onnx"
    args = ["--dim", "batch=1", "--dim", "seq=8"]
    code, printed = run_cli(["inspect", str(model), *args, "--report", str(tmp_path / "r")], capsys)
    assert code == 0, printed
    text = check_page(
        tmp_path / "r" / "index.html", drawn_nodes(model, "batch=1", "seq=8"), tmp_path
    )
    # The tables are the ones inspect printed, numbers and all.
    line = next(ln for ln in printed.splitlines() if ln.startswith("memory plan: arena"))
    arena = re.search(r"arena (\d+) B", line)
    assert arena is not None and f"arena {arena[1]} B" in text
    assert "FusedAttention" in text and "LayerNormalization" in text
    # The buffers named are the plan's largest, and the live curve peaks at the most bytes
    # any step has live (counted here from the buffers' intervals).
    from flowc.compiler import plan_schedule, schedule_graph

    plan = plan_schedule(schedule_graph(load_model(ModelArgs(model, dims=tuple(args[1::2])))))
    table = text[text.index("<th>largest buffers</th>") :]
    table = table[: table.index("</table>")]
    listed = [int(b) for b in re.findall(r"<td class=num>(\d+)</td><td class=num>\d+</td>", table)]
    assert listed == sorted((b.size for b in plan.buffers), reverse=True)[: len(listed)]
    assert len(listed) == min(8, len(plan.buffers))
    live = max(
        sum(b.size for b in plan.buffers if b.start <= t <= b.end) for t in range(len(plan.steps))
    )
    assert f"(peak {live} B;" in text


def test_report_collapses_densenet_into_its_dense_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need_tools()
    model = LIGHT_DIR / "light_densenet121.onnx"
    graph = load_model(ModelArgs(model))
    items = collapse(graph)
    # DenseNet-121 is named for its dense blocks of 6, 12, 24 and 16 layers.
    assert [it.repeats for it in items if it.kind == "repeat"] == [6, 12, 24, 16]
    assert len(items) < len(graph.nodes) / 5
    assert sum(len(it.nodes) for it in items) == len(graph.nodes)
    code, printed = run_cli(["inspect", str(model), "--report", str(tmp_path / "r")], capsys)
    assert code == 0, printed
    text = check_page(
        tmp_path / "r" / "index.html", len(items) + len(graph.inputs) + len(graph.outputs), tmp_path
    )
    assert "24 x block of" in text


def hostile_model(path: Path) -> str:
    """An ONNX model whose names try to break out of DOT strings and HTML."""
    evil = 'x"\\" ] ; n0 -> n1 [label="<b>&amp;\n</svg><script>alert(1)</script>$a$'
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), f"{evil}.weight")
    nodes = [
        helper.make_node("MatMul", [f"{evil}.in", w.name], [f"{evil}.mm"], name=f"{evil}/MatMul"),
        helper.make_node("Relu", [f"{evil}.mm"], [f"{evil}.out"], name=f"{evil}\\Relu"),
    ]
    g = helper.make_graph(
        nodes,
        f"{evil} graph",
        [helper.make_tensor_value_info(f"{evil}.in", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info(f"{evil}.out", TensorProto.FLOAT, [2, 4])],
        [w],
    )
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    return evil


def test_report_escapes_hostile_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    need_tools()
    model = tmp_path / "evil.onnx"
    hostile_model(model)
    code, printed = run_cli(["inspect", str(model), "--report", str(tmp_path / "r")], capsys)
    assert code == 0, printed
    text = check_page(tmp_path / "r" / "index.html", drawn_nodes(model), tmp_path)
    assert "<script" not in text and "</svg><" not in text.replace("</svg></div>", "")
    assert "&lt;/svg&gt;&lt;script&gt;" in text  # the name is shown, as text


def test_report_marks_layouts_collectives_and_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need_tools()
    code, printed = run_cli(
        [
            "inspect",
            str(SHARED_MODELS / "mlp.onnx"),
            "--mesh",
            "2",
            "--parallel",
            "data",
            "--report",
            str(tmp_path / "mesh"),
        ],
        capsys,
    )
    assert code == 0, printed
    text = (tmp_path / "mesh" / "index.html").read_text(encoding="utf-8")
    svg = text[text.index("<svg") : text.index("</svg>")]
    labels = re.findall(r"<text[^>]*>([^<]*)</text>", svg)
    assert "S(0)" in labels  # data parallel: the input split on the batch
    # Each collective of the printed plan's table is named on an edge.
    table = printed[printed.index("collectives") :]
    for name in re.findall(r"\b(all-gather|all-reduce|reduce-scatter|all-to-all)\b", table):
        assert name.replace("-", "&#45;") in labels
    assert any("all" in lb for lb in labels)

    flow = tmp_path / "staged.flow"
    flow.write_text(
        "graph mlp(x: f32[8, 64]) -> (y: f32[8, 10]) {\n"
        "    param w1: f32[64, 256] = normal(0.0, 0.125)\n"
        "    param w2: f32[256, 10] = normal(0.0, 0.0625)\n"
        "    stage 0 {\n        h = relu(x @ w1)\n    }\n"
        "    stage 1 {\n        y = softmax(h @ w2, axis=-1)\n    }\n"
        "    return y\n}\n"
    )
    code, printed = run_cli(["inspect", str(flow), "--report", str(tmp_path / "st")], capsys)
    assert code == 0, printed
    text = (tmp_path / "st" / "index.html").read_text(encoding="utf-8")
    assert "stage 0" in text and "stage 1" in text and "stage 0 &#45;&gt; 1" in text


def test_report_without_dot_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code, printed = run_cli(
        ["inspect", str(SHARED_MODELS / "mlp.onnx"), "--report", str(tmp_path / "r")], capsys
    )
    assert code != 0
    assert "dot" in printed and "apt-get install graphviz" in printed
    assert "Traceback" not in printed
    assert not (tmp_path / "r").exists()


def test_page_errors_keeps_console_lines_and_drops_known_noise() -> None:
    # Lines as Chromium 156 writes them (a CSP refusal is how a request from the page shows).
    noise = (
        "/usr/bin/chromium: 9: [: 25275973632: unexpected operator\n"
        "[1:2:1202/144013.208835:ERROR:dbus/bus.cc:405] Failed to connect to the bus\n"
        "[3:3:1202/144013.496070:WARNING:media/gpu/vaapi/vaapi_wrapper.cc:1655] drmGetDevices2()\n"
        "[1:1:1202/145344.730151:ERROR:mojo/public/cpp/bindings/lib/interface_endpoint_client.cc:652]"
        " Message 1102119957 rejected by interface blink.mojom.FrameWidgetHost\n"
        "229421 bytes written to file /tmp/shot.png\n"
    )
    page = (
        "[1:1:1202/145344.670914:INFO:CONSOLE:1] \"Loading the image 'http://example.com/x.png' "
        'violates the following Content Security Policy directive", source: file:///p.html (1)\n'
        "[1:1:1202/145344.670914:ERROR:third_party/blink/renderer/x.cc:1] something new\n"
    )
    assert page_errors(noise) == []
    assert len(page_errors(noise + page)) == 2


def _chain(names: list[str], ops: list[str]) -> Graph:
    from flowc.ir.dtype import DType
    from flowc.ir.types import TensorType

    t = TensorType((4,), DType.from_numpy(np.dtype(np.float32)))
    g = Graph("chain")
    v = g.add_input("x", t)
    for name, op in zip(names, ops, strict=True):
        v = g.add_node(op, [v], [t], name=name).outputs[0]
    g.outputs.append(v)
    return g


def test_collapse_falls_back_to_name_prefixes_then_chunks() -> None:
    rng = np.random.default_rng(0)
    kinds = ["Relu", "Sigmoid", "Tanh", "Neg", "Abs", "Exp", "Sqrt", "Floor"]
    # Seeded random ops: no repeated block worth a cluster, 300 nodes.
    ops = [str(rng.choice(kinds)) for _ in range(300)]
    g = _chain([f"/layer.{k // 10}/op{k}" for k in range(300)], ops)
    by_prefix = collapse(g, 200)
    # Each layer's ten nodes, named /layer.k/..., are one item.
    assert [(it.kind, it.prefix, len(it.nodes)) for it in by_prefix] == [
        ("prefix", f"/layer.{k}", 10) for k in range(30)
    ]
    assert [n for it in by_prefix for n in it.nodes] == g.nodes
    # Without prefixes: chunks, as few as bring it under the limit, every node once in order.
    g = _chain([f"op{k}" for k in range(300)], ops)
    items = collapse(g, 200)
    assert len(items) <= 200
    assert [n for it in items for n in it.nodes] == g.nodes
    assert any(it.kind == "chunk" for it in items)


def test_report_labels_nodes_by_their_model_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import html

    from test_schedule import HOSTILE, LABELS, labelled_model

    need_tools()
    model = labelled_model(tmp_path / "labels.onnx")
    args = ["inspect", str(model), "--report", str(tmp_path / "r"), "--schedule", "--streams", "1"]
    code, printed = run_cli(args, capsys)
    assert code == 0, printed
    page = (tmp_path / "r" / "index.html").read_text(encoding="utf-8")
    svg = page[page.index("<svg") : page.index("</svg>")]
    # Each box: its op, then its label (at most 40 characters in the picture), all distinct.
    boxes = re.findall(r"<text [^>]*>([^<]*)</text>\n<text [^>]*>([^<]*)</text>", svg)
    shown = [html.unescape(label) for _, label in boxes]
    assert shown == [
        "model/layers.0/self_attn/q_proj/MatMul",
        "…/bold] <b>&amp;</b> :smile:",  # "/" in "[/bold]": the markup's middle goes
        "model/layers.0/self_attn/k_proj/Softmax",
        "…/out_proj/Softmax #3",
        "attn/out",
        "…/out_proj/Softmax #5",
        "pre",
        "model/layers.9/mlp/fc1",
        "n10",
    ]
    # Escaped for HTML (and for dot: "&amp;" in a name is shown, not read as "&").
    assert "<b>" not in page and "&lt;b&gt;&amp;amp;&lt;/b&gt;" in svg
    # The printed schedule on the page: the text views' labels, escaped.
    tables = page[page.index('<section id="tables">') :]
    for label in LABELS:
        assert html.escape(label, quote=False) in tables, label
    assert html.escape(HOSTILE, quote=False) in tables
    # The memory table names each step by its node's label too.
    memory = page[page.index('<section id="memory">') : page.index('<section id="schedule">')]
    assert "<td>4: attn/out [Softmax]</td>" in memory
    assert "7: model/layers.9/mlp/fc1 [MatMul]" in memory
