"""The full-size random-init benchmark bundles, built once per family and cached under the models directory
(git-ignored): the one loadtest module that names the families (BUILDERS)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
FULL_CONFIG = REPO / "export" / "configs" / "cosyvoice-300m-sft.yaml"
V2_CONFIG = REPO / "export" / "configs" / "cosyvoice2-0.5b"  # cosyvoice2.yaml + CosyVoice-BlankEN/config.json
V3_CONFIG = REPO / "export" / "configs" / "fun-cosyvoice3-0.5b"  # cosyvoice3.yaml + CosyVoice-BlankEN/config.json
SCHEMES = ("int8", "int4")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def bundle_dirs(models: Path) -> dict[str, Path]:
    return {"fp32": models / "full-random"} | {s: models / f"full-random-{s}" for s in SCHEMES}


def _stale(path: Path, scheme: str) -> bool:
    """A quantized bundle written with another precision plan (or K/V cache type) than the current export code's."""
    from export.quantize import FLOAT_TWIN_GRAPHS, FLOAT_TWIN_PRECISION, HALF_KV_GRAPH, kv_cache_dtype, precision_plan
    from service.bundle import FLOAT_SUFFIX, ModelBundle

    bundle = ModelBundle.load(path)
    graphs = bundle.manifest.graphs
    wanted = precision_plan(scheme)  # type: ignore[arg-type]
    if kv_cache_dtype(bundle.graph_path(HALF_KV_GRAPH)) != "float16":
        return True
    twins = [graphs.get(name + FLOAT_SUFFIX) for name in FLOAT_TWIN_GRAPHS if name in wanted]
    if any(twin is None or twin.precision != FLOAT_TWIN_PRECISION for twin in twins):
        return True
    return any(g.precision != wanted.get(name, "fp32") for name, g in bundle.manifest.graphs_in("core").items())


def ensure_bundles(models: Path) -> dict[str, Path]:
    """Export the fp32 random-init bundle (and its quantized twins) unless they exist; cached under `models`."""
    dirs = bundle_dirs(models)
    if not (dirs["fp32"] / "manifest.json").is_file():
        src = models / ".full-random-src"
        src.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(FULL_CONFIG, src / "cosyvoice.yaml")
        cmd = [PYTHON, "export/export_onnx.py", "--model-dir", str(src), "--out", str(dirs["fp32"]), "--random-init"]
        cmd += [arg for s in SCHEMES for arg in ("--quantize", s)]
        log(f"building full-size random-init bundles: {' '.join(cmd)}")
        subprocess.run(cmd, cwd=REPO, check=True)
    from export.bundle_writer import publish, staging_dir
    from export.quantize import write_quantized_bundle
    from service.bundle import ModelBundle

    for scheme in SCHEMES:
        path = dirs[scheme]
        if (path / "manifest.json").is_file() and not _stale(path, scheme):
            if scheme == "int8":
                _refresh_native_twins(path)
            continue
        log(f"writing {path} ({scheme})")
        tmp = staging_dir(path, "partial")
        write_quantized_bundle(dirs["fp32"], tmp, ModelBundle.load(dirs["fp32"]).manifest, scheme)  # type: ignore[arg-type]
        _refresh_native_twins(tmp)
        publish(tmp, path)
    return dirs


def _refresh_native_twins(bundle_dir: Path) -> None:
    """Give a quantized bench bundle the native twins its family's exporter writes now: the missing ones, or all of them
    again when a twin predates a fused kernel its family's rewrite makes now (FamilyExporter.fused_ops) or reads its
    caches in float16 where the rewrite now reads them in int8 (export/native_twin.int8_block_caches)."""
    import onnx

    from export.native_twin import drop_native_twins, write_native_twin
    from export.registry import for_family
    from service.bundle import ModelBundle
    from service.engine.runtimes import reads_int8_caches

    bundle = ModelBundle.load(bundle_dir)
    exporter = for_family(bundle.family)
    for graph, op in exporter.fused_ops.items():
        twin = bundle.native_graph_path(graph)
        if twin is None:
            continue
        caches = graph.startswith("flow_") and any(i.startswith("past_k_") for i in bundle.manifest.graphs[graph].inputs)
        float_caches = caches and not reads_int8_caches(bundle, graph)
        if float_caches or not any(n.op_type == op for n in onnx.load(str(twin)).graph.node):
            drop_native_twins(bundle_dir)
            break
    write_native_twin(bundle_dir, exporter.native_rewrites, log=log)


def ensure_v2_bundle(models: Path) -> Path:
    """The full-size random-init CosyVoice2 int8 bundle (and its fp32 source), exported once under `models`; a bundle
    written by an older exporter (an estimator float twin, or estimator caches heads-first) is exported again."""
    fp32, int8 = models / "full-random-cosyvoice2", models / "full-random-cosyvoice2-int8"
    if (int8 / "manifest.json").is_file() and not _v2_stale(int8):
        _refresh_native_twins(int8)
        return int8
    for old in (fp32, int8):
        if old.exists():
            shutil.rmtree(old)
    cmd = [PYTHON, "export/export_onnx.py", "--model-dir", str(V2_CONFIG), "--out", str(fp32), "--random-init"]
    log(f"building the full-size random-init CosyVoice2 bundles: {' '.join([*cmd, '--quantize', 'int8'])}")
    subprocess.run([*cmd, "--quantize", "int8"], cwd=REPO, check=True)
    return int8


def _v2_stale(int8: Path) -> bool:
    import onnx

    graphs = json.loads((int8 / "manifest.json").read_text())["graphs"]
    if "flow_estimator_float" in graphs:
        return True
    model = onnx.load(str(int8 / graphs["flow_estimator"]["file"]), load_external_data=False)
    past = next(v for v in model.graph.input if v.name == "past_k_0")
    return not past.type.tensor_type.shape.dim[1].dim_param  # time-first caches: (B, C, H, DK)


def ensure_v3_bundle(models: Path) -> Path:
    """The full-size random-init Fun-CosyVoice3 int8 bundle (and its fp32 source), exported once under `models`."""
    fp32, int8 = models / "full-random-cosyvoice3", models / "full-random-cosyvoice3-int8"
    if (int8 / "manifest.json").is_file():
        _refresh_native_twins(int8)
        return int8
    for old in (fp32, int8):
        if old.exists():
            shutil.rmtree(old)
    cmd = [
        PYTHON,
        "export/export_onnx.py",
        "--model-dir",
        str(V3_CONFIG),
        "--out",
        str(fp32),
        "--random-init",
        "--quantize",
        "int8",
    ]
    log(f"building the full-size random-init Fun-CosyVoice3 bundles: {' '.join(cmd)}")
    subprocess.run(cmd, cwd=REPO, check=True)
    return int8


def _v1_int8(models: Path) -> Path:
    return ensure_bundles(models)["int8"]


# family -> the int8 benchmark bundle of that family under a models directory (built the first time).
BUILDERS: dict[str, Callable[[Path], Path]] = {
    "cosyvoice1": _v1_int8, "cosyvoice2": ensure_v2_bundle, "cosyvoice3": ensure_v3_bundle,
}  # fmt: skip
# family -> the analysis variant its saved voices hold (PromptFeatures.mel_variant), for voices the benches store
VOICE_VARIANTS: dict[str, str] = {"cosyvoice1": "trained", "cosyvoice2": "cosyvoice2", "cosyvoice3": "cosyvoice3"}
