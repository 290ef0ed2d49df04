"""The Python side of ``benchmarks/gpu.sh``: environment, per-part records, the report.

``gpu.sh`` runs each part under ``timeout`` with its output in ``<run>/<part>.log`` and
its figures in ``<run>/<part>.json`` (pytest parts: ``<run>/<part>.xml``, JUnit). This
script does everything that is not running a command:

    python benchmarks/gpu_report.py env --run DIR [--dry-run]
        writes DIR/env.json (device, versions, git commit, date); without --dry-run it
        exits 3 when torch sees no CUDA device.
    python benchmarks/gpu_report.py record --run DIR --name PART --rc RC --started T
            --timeout S --signal SIG [--result FILE] [--missing PATH] [--skipped WHY]
            -- COMMAND...
        writes DIR/PART.part.json: what ran, when (start and end, unix s) and how it
        ended, or why it did not run (--skipped: the time budget).
    python benchmarks/gpu_report.py assemble --run DIR --results DIR
        merges them into RESULTS/gpu-<device>.json and RESULTS/gpu-<device>.md, and
        lists those two paths in DIR/outputs.

The JSON: ``device``, ``versions``, ``git``, ``date``, ``dry_run``, ``budget`` (the
budget, the boxes, the wall time), ``parts`` (per part, in the order they ran: command,
time box, status ok / failed / timeout / not run, exit code, start, end and wall time,
reason, log file and tail), ``tests`` (the two pytest parts' counts, failures and skip
reasons), then one section per benchmark (`SECTIONS`). A section holds the script's own
JSON, or ``{"status", "reason"}`` where the part gave none (added to the JSON it gave
where it timed out or failed after writing it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"

# Every part gpu.sh knows, in the order it runs them (one at a time: the GPU parts, then
# the CPU suite): (name, kind). kind "tests" parts leave JUnit XML, "bench" parts a JSON.
PARTS = [("import_time", "bench"), ("gpu_tests", "tests"), ("jax_gpu_compile", "bench"),
         ("compare_modes", "bench"), ("fp8", "bench"), ("trainers", "bench"),
         ("torch_modes", "bench"), ("jax_scale_cost", "bench"), ("jax_loss_scale", "bench"),
         ("unscale_bandwidth", "bench"), ("precision_report", "bench"),
         ("cpu_suite", "tests")]
SECTIONS = [name for name, kind in PARTS if kind == "bench"]
CPU_PARTS = {"cpu_suite"}  # after every GPU part, on every core
TIMEOUT_RCS = {124, 137}  # timeout(1): the signal was sent; the KILL after -k was needed
TAIL_LINES = 40

VERSIONED = ["torch", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt",
             "jax-cuda12-plugin", "flax", "optax", "chex", "transformers", "numpy",
             "ml-dtypes", "pytest", "pytest-xdist", "pytest-benchmark", "hypothesis", "jmp",
             "dm-haiku", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cublas"]


# ----------------------------------------------------------------------------- env
def _run(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def cpu_name():
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return platform.processor() or platform.machine()


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def collect_env(dry_run):
    versions = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    device = {"cpu": cpu_name(), "cpu_count": os.cpu_count()}
    try:
        import torch
    except ImportError as e:
        device["torch_error"] = str(e)
        torch = None
    if torch is not None:
        versions["torch_cuda"] = torch.version.cuda
        versions["cudnn"] = (torch.backends.cudnn.version()
                             if torch.version.cuda and torch.cuda.is_available() else None)
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            device.update(gpu=torch.cuda.get_device_name(0), gpu_count=torch.cuda.device_count(),
                          compute_capability=f"{props.major}.{props.minor}",
                          gpu_memory_gib=round(props.total_memory / 2**30, 1))
    if shutil.which("nvidia-smi"):
        device["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,"
                                     "memory.total", "--format=csv,noheader"])
    if dry_run:
        device["name"] = f"CPU dry run: {device['cpu']}"
        device["slug"] = "cpu-dry-run"
    else:
        device["name"] = device.get("gpu", "no CUDA device")
        device["slug"] = slug(device["name"])
    return {
        "device": device,
        "versions": versions,
        "git": git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": dry_run,
        "platform": platform.platform(),
        "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS",
                                               "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES",
                                               "HF_HUB_OFFLINE", "PYTHONPATH")},
    }


def git_commit(root=ROOT):
    """``{"commit", "dirty", "source"}``: ``$MPFUNC_COMMIT`` when set (a copy of the
    checkout without its .git), else git's, but only when git's top level is this
    checkout (not an enclosing repository that a copy was put inside), else unknown."""
    if os.environ.get("MPFUNC_COMMIT"):
        return {"commit": os.environ["MPFUNC_COMMIT"], "dirty": None, "source": "MPFUNC_COMMIT"}
    top = _run(["git", "-C", str(root), "rev-parse", "--show-toplevel"])
    if top is None or Path(top).resolve() != Path(root).resolve():
        return {"commit": None, "dirty": None,
                "source": "unknown: no MPFUNC_COMMIT, and the checkout is not its own git "
                          "repository" + (f" (git's top level is {top})" if top else "")}
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return {"commit": _run(["git", "-C", str(root), "rev-parse", "HEAD"]),
            "dirty": None if dirty is None else bool(dirty), "source": "git"}


def cmd_env(args):
    env = collect_env(args.dry_run)
    env["started_unix"] = args.started
    Path(args.run, "env.json").write_text(json.dumps(env, indent=2))
    print(f"[gpu.sh] device: {env['device']['name']}; python {env['versions']['python']}, "
          f"torch {env['versions']['torch']} (CUDA {env['versions'].get('torch_cuda')}), "
          f"jax {env['versions']['jax']}, flax {env['versions']['flax']}, optax "
          f"{env['versions']['optax']}; commit {env['git']['commit']}")
    if not args.dry_run and "gpu" not in env["device"]:
        print("gpu.sh: torch sees no CUDA device here; run it on a GPU machine, or "
              "`bash benchmarks/gpu.sh --cpu-dry-run` to try the pipeline on CPU.",
              file=sys.stderr)
        return 3
    return 0


# -------------------------------------------------------------------------- record
def cmd_record(args):
    ended = datetime.datetime.now().timestamp()
    rec = {"name": args.name, "command": shlex.join(args.command), "timeout_s": args.timeout,
           "signal": args.signal, "rc": args.rc, "started_unix": args.started,
           "ended_unix": ended, "wall_s": round(ended - args.started, 2),
           "log": f"{args.name}.log", "result": args.result, "missing": args.missing,
           "skipped": args.skipped}
    Path(args.run, f"{args.name}.part.json").write_text(json.dumps(rec, indent=2))
    return 0


# ------------------------------------------------------------------------ assemble
def log_tail(path, lines=TAIL_LINES):
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    all_lines = text.splitlines()
    tail = "\n".join(all_lines[-lines:])[-6000:]
    # A hung part's faulthandler dump (a deep stack, then the list of extension modules) can
    # push its first line, the one that says what happened, out of the tail: keep it.
    fatal = [line for line in all_lines if line.startswith("Fatal Python error")]
    if fatal and fatal[-1] not in tail:
        tail = f"{fatal[-1]}\n[...]\n{tail}"
    return tail


def junit_summary(path):
    """Counts, failures and skip reasons from a pytest JUnit XML file (None if absent)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], {}
    for case in root.iter("testcase"):
        counts["tests"] += 1
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                msg = (child.get("message") or "").strip().splitlines()
                failures.append({"test": test_id, "kind": child.tag,
                                 "message": (msg[0] if msg else "")[:300]})
                break
            if child.tag == "skipped":
                outcome = "skipped"
                reason = (child.get("message") or "").strip()[:200]
                skips[reason] = skips.get(reason, 0) + 1
                break
        counts[outcome] += 1
    top = dict(sorted(skips.items(), key=lambda kv: -kv[1])[:25])
    return {**counts, "failures": failures, "skip_reasons": top}


def pytest_line(log):
    """The summary line's counts ('3 failed, 10 passed in 5s') from a pytest log."""
    for line in reversed(log.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)",
                           line)
        if found and (" in " in line or "Interrupted" in line or "=" in line):
            return {k if k != "error" else "errors": int(n) for n, k in found}
    return None


def status_of(rec, kind, run):
    """(status, reason) of one part's record."""
    if rec.get("skipped"):
        return "not run", rec["skipped"]
    if rec.get("missing"):
        return "failed", f"{rec['missing']} is missing"
    rc = rec["rc"]
    if rc in TIMEOUT_RCS:
        cut = " (its box was what the budget had left: cut by the budget)" \
            if rec["name"] in CPU_PARTS else ""
        return "timeout", (f"ran past its {rec['timeout_s']} s time box (sent SIG"
                           f"{rec['signal']}{', then KILL' if rc == 137 else ''}){cut}")
    if rc != 0:
        if kind == "tests" and rc == 1:
            return "failed", "some tests failed (pytest exit 1)"
        return "failed", f"exit code {rc}"
    if kind == "bench" and load_json(run, rec) is None:
        return "failed", f"exited 0 but wrote no JSON at {rec.get('result')}"
    return "ok", None


def load_json(run, rec):
    if not rec.get("result"):
        return None
    try:
        return json.loads(Path(run, Path(rec["result"]).name).read_text())
    except (OSError, ValueError):
        return None


def section_of(name, data):
    """(section, markdown or None) from a part's JSON: the script's own section (a JSON
    wrapped as ``{name: section}`` is unwrapped) and the markdown it wrote, if any."""
    if not isinstance(data, dict):
        return data, None
    inner = data.get(name, data) if name in ("compare_modes", "fp8", "trainers") else data
    md = data.get("markdown")
    if md is None and isinstance(inner, dict):
        md = inner.get("markdown")
    return inner, md


def bench_markdown(name, data):
    """A benchmark's own table (its to_markdown), or None."""
    modules = {"jax_loss_scale": "jax_loss_scale", "jax_scale_cost": "jax_scale_cost",
               "unscale_bandwidth": "unscale_bandwidth", "torch_modes": "torch_modes",
               "precision_report": "precision_report", "import_time": "import_time"}
    if name not in modules:
        return None
    sys.path.insert(0, str(BENCH))
    try:
        module = __import__(modules[name])
        return module.to_markdown(data)
    except Exception as e:  # noqa: BLE001 - a broken table must not lose the figures
        return f"(no table: {type(e).__name__}: {e})"
    finally:
        sys.path.remove(str(BENCH))


def assemble(run, results, budget_s=540):
    run, results = Path(run), Path(results)
    env_path = run / "env.json"
    env = json.loads(env_path.read_text()) if env_path.exists() else collect_env(False)
    parts, tests, sections, md_sections = {}, {}, {}, {}
    for name, kind in PARTS:
        rec_path = run / f"{name}.part.json"
        if not rec_path.exists():
            parts[name] = {"status": "not run", "reason": "not selected, or gpu.sh stopped "
                           "before it"}
            if kind == "bench":
                sections[name] = {"status": "not run"}
            continue
        rec = json.loads(rec_path.read_text())
        status, reason = status_of(rec, kind, run)
        log = log_tail(run / rec["log"])
        parts[name] = {**rec, "status": status, "reason": reason, "log_tail": log}
        if kind == "tests":
            summary = junit_summary(run / f"{name}.xml") or {}
            summary["summary_line"] = pytest_line(log)
            tests[name] = summary
            continue
        data = load_json(run, rec)
        if data is None:
            sections[name] = {"status": status, "reason": reason}
            continue
        sections[name], md = section_of(name, data)
        if status != "ok" and isinstance(sections[name], dict):
            # A part that timed out or failed after writing its JSON (a benchmark that
            # writes row by row): its figures stay, marked as what an incomplete run gave.
            sections[name] = {**sections[name], "status": status, "reason": reason}
        md_sections[name] = md or bench_markdown(name, sections[name])
    gpu_boxes = sum(p.get("timeout_s", 0) for n, p in parts.items()
                    if n not in CPU_PARTS and "timeout_s" in p)
    report = {
        "device": env["device"], "versions": env["versions"], "git": env["git"],
        "date": env["date"], "dry_run": env["dry_run"], "platform": env.get("platform"),
        "env": env.get("env", {}),
        "budget": {"total_s": budget_s, "gpu_parts_time_boxes_s": gpu_boxes,
                   "cpu_suite_time_box_s": parts.get("cpu_suite", {}).get("timeout_s"),
                   "wall_s": (round(datetime.datetime.now().timestamp() - env["started_unix"], 1)
                              if env.get("started_unix") else None),
                   "not_run_for_budget": [n for n, p in parts.items()
                                          if p["status"] == "not run" and p.get("skipped")]},
        "started_unix": env.get("started_unix"), "overlaps": overlaps(parts),
        "parts": parts, "tests": tests, **sections,
    }
    results.mkdir(parents=True, exist_ok=True)
    stem = f"gpu-{env['device']['slug']}"
    json_path, md_path = results / f"{stem}.json", results / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    md_path.write_text(to_markdown(report, md_sections))
    return json_path, md_path, report


def overlaps(parts):
    """Pairs of parts whose runs overlapped in time (none: gpu.sh runs one at a time)."""
    spans = sorted((p["started_unix"], p["ended_unix"], n) for n, p in parts.items()
                   if p.get("started_unix") is not None and p.get("ended_unix") is not None
                   and p["status"] != "not run")
    return [[a, b] for (_, end_a, a), (start_b, _, b) in zip(spans, spans[1:])
            if start_b < end_a]


def to_markdown(r, md_sections):
    v = r["versions"]
    head = (f"## GPU run: {r['device']['name']}, {r['date']}\n\n"
            f"Command: `make gpu` (`bash benchmarks/gpu.sh{' --cpu-dry-run' if r['dry_run'] else ''}`)"
            f", commit {r['git']['commit'] or 'unknown'}"
            f"{' (with local changes)' if r['git'].get('dirty') else ''}. Python {v['python']}, "
            f"torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), jax {v.get('jax')} "
            f"(CUDA plugin {v.get('jax-cuda13-plugin') or v.get('jax-cuda12-plugin')}), "
            f"flax {v.get('flax')}, optax {v.get('optax')}. Wall time "
            f"{r['budget']['wall_s']} s of a {r['budget']['total_s']} s budget; the parts ran "
            "one at a time, the GPU parts alone on the machine, then the CPU suite on every "
            "core.\n")
    cut = r["budget"].get("not_run_for_budget")
    if cut:
        head += f"\nNot run, for the time budget: {', '.join(cut)}.\n"
    if r["dry_run"]:
        head += ("\n**CPU dry run**: every part at a tiny size on CPU, to check the pipeline; "
                 "no figure here is a GPU figure.\n")
    lines = [head, "| part | status | from-to (s) | time box (s) | command |",
             "| --- | --- | --- | --- | --- |"]
    t0 = r.get("started_unix")
    for name, p in r["parts"].items():
        status = p["status"] + (f": {p['reason']}" if p.get("reason") else "")
        span = (f"{p['started_unix'] - t0:.0f}-{p['ended_unix'] - t0:.0f}"
                if t0 and p.get("started_unix") and p["status"] != "not run" else "-")
        lines.append(f"| {name} | {status} | {span} | "
                     f"{p.get('timeout_s', '-')} | `{p.get('command', '-')}` |")
    for name, t in r["tests"].items():
        counts = ", ".join(f"{t[k]} {k}" for k in ("passed", "failed", "errors", "skipped")
                           if t.get(k)) or f"no JUnit counts; summary {t.get('summary_line')}"
        lines += ["", f"### {name}: {counts}"]
        for f in t.get("failures", [])[:30]:
            lines.append(f"- {f['kind']}: `{f['test']}`: {f['message']}")
        for reason, n in list(t.get("skip_reasons", {}).items())[:10]:
            lines.append(f"- skipped x{n}: {reason}")
    for name in SECTIONS:
        lines += ["", f"### {name}", ""]
        part = r["parts"][name]
        if part["status"] != "ok":
            lines.append(f"Status: {part['status']}"
                         + (f" ({part['reason']})" if part.get("reason") else "") + ".")
            if part.get("log_tail"):
                tail = "\n".join(part["log_tail"].splitlines()[-15:])
                lines += ["", "```", tail, "```"]
        md = md_sections.get(name)
        if md:
            lines += ["", md.strip("\n")] if part["status"] != "ok" else [md.strip("\n")]
    return "\n".join(lines) + "\n"


def cmd_assemble(args):
    json_path, md_path, report = assemble(args.run, args.results, args.budget)
    Path(args.run, "outputs").write_text(f"{json_path}\n{md_path}\n")
    bad = {n: p["status"] for n, p in report["parts"].items()  # not run: left out with
           if p["status"] not in ("ok", "not run") or p.get("skipped")}  # --parts, or cut
    print(f"[gpu.sh] wrote {json_path} and {md_path}")
    print("[gpu.sh] parts: " + ", ".join(f"{n} {p['status']}" for n, p in report["parts"].items()))
    return 1 if bad else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("env")
    e.add_argument("--run", required=True)
    e.add_argument("--dry-run", action="store_true")
    e.add_argument("--started", type=float, default=None, help="gpu.sh's start (unix s)")
    r = sub.add_parser("record")
    r.add_argument("--run", required=True)
    r.add_argument("--name", required=True, choices=[n for n, _ in PARTS])
    r.add_argument("--rc", type=int, required=True)
    r.add_argument("--started", type=float, required=True, help="the part's start (unix s)")
    r.add_argument("--timeout", type=int, required=True)
    r.add_argument("--signal", default="ABRT")
    r.add_argument("--result", default=None)
    r.add_argument("--missing", default=None)
    r.add_argument("--skipped", default=None, help="why the part did not run")
    r.add_argument("command", nargs=argparse.REMAINDER)
    a = sub.add_parser("assemble")
    a.add_argument("--run", required=True)
    a.add_argument("--results", required=True)
    a.add_argument("--budget", type=int, default=540, help="gpu.sh's whole time budget (s)")
    args = ap.parse_args(argv)
    if args.what == "record":
        if args.command[:1] == ["--"]:
            args.command = args.command[1:]
        if not args.command:
            ap.error("record needs the part's command after --")
        return cmd_record(args)
    return cmd_env(args) if args.what == "env" else cmd_assemble(args)


if __name__ == "__main__":
    sys.exit(main())
