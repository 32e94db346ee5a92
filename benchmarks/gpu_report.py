"""The GPU benchmark plan's results (benchmarks/benchmark_gpu.py): results.json and results.md
written after every part, the markdown tables, and the merge of several partial runs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_plan import PARTS, part_status


def save(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(render(results))


# ---------------------------------------------------------------------------------- markdown
def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return str(x)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _gib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2 ** 30:.3g}"


def _status(run: dict) -> str:
    return f"{run['status']}: {run.get('reason') or run.get('error', '')}".strip().rstrip(":")


def _cmd(run: dict) -> str:
    return f"`{run['command']}`" if run.get("command") else ""


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |"
                    for row in rows]


def render(results: dict) -> str:
    env = results.get("environment") or {}
    parts = results.get("parts", {})
    lines = ["# GPU benchmark plan: results", "",
             f"{env.get('n_devices')} x {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
             f"torch {env.get('torch')}, {env.get('cpu_count')} CPU cores; {results.get('date')}; "
             f"`{results.get('command')}`. XLA_PYTHON_CLIENT_MEM_FRACTION={env.get('mem_fraction')}.", ""]
    if "step" in parts:
        p = parts["step"]
        lines += [f"## Train step ({(results.get('plan') or {}).get('config')}) — {p['status']}", ""]
        rows = []
        for run in p["runs"]:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], *["—"] * 8, _status(run), _cmd(run)])
                continue
            mm = x.get("matmul") or {}
            rows.append([x["per_device_batch"], _f(x["compile_s"]), _f(x["step_s"] * 1e3), _f(x["samples_per_s_per_device"]),
                         _f(x["tflops_per_device"]), _pct(x["mfu"]), _pct(mm.get("step_fraction")),
                         _gib((x.get("device_memory") or {}).get("peak_bytes_in_use")),
                         f"{x['dtype']} compute, {'/'.join(x['param_dtypes'])} params, attention "
                         f"{x['attention_impl_resolved']}, remat {x['remat']}"
                         + (f"; {x['device_memory_skipped']}" if x.get("device_memory_skipped") else ""), _cmd(run)])
        lines += _table(["per-device batch", "compile (s)", "step (ms)", "samples/s per device", "TFLOP/s per device",
                         "MFU", "of a bf16 matmul's TFLOP/s", "peak memory (GiB)", "notes", "command"], rows)
        main = (p["runs"][0].get("result") or {}) if p["runs"] else {}
        if main.get("matmul"):
            mm = main["matmul"]
            lines += ["", f"Plain {mm['n']}³ bf16 matmul in the same process: {_f(mm['tflops'])} TFLOP/s; "
                          f"peak used for MFU: {_f(main.get('peak_tflops_per_device'))} TFLOP/s."]
        if p.get("profile"):
            lines += ["", f"Profile of {main.get('profile_steps')} steps: `{p['profile']}` "
                          "(`tar xzf profile.tar.gz; xprof --logdir=profile`; "
                          "`python benchmarks/profile_breakdown.py profile`)."]
        b = p.get("breakdown")
        if b:
            lines += ["", f"Device time per step: {_f(b['device_ms_per_step'])} ms: " + "; ".join(
                f"{k} {_f(ms)} ms" for k, ms in b["classes_ms_per_step"].items()) + ". Costliest fusions:", ""]
            lines += _table(["ms per step", "kernels per step", "JAX op", "output"],
                            [[_f(x["ms_per_step"]), _f(x["per_step"]), f"`{x['op_name'][-100:]}`", x["shape"]]
                             for x in b["top_fusions"][:10]])
        lines.append("")
    if "max_batch" in parts:
        p = parts["max_batch"]
        lines += [f"## Largest per-device batch per remat policy — {p['status']}", ""]
        rows = []
        for run in p["runs"]:
            mb = (run.get("result") or {}).get("max_batch")
            if mb:
                rows.append([run["name"], mb["max_per_device_batch"],
                             _f(None if mb["first_failing_global_batch"] is None
                                else mb["first_failing_global_batch"] // max(1, run["result"]["n_devices"])),
                             len(mb["probes"]), _status(run) if run["status"] != "ok" else "ok", _cmd(run)])
            else:
                probes = (run.get("result") or {}).get("max_batch_probes") or []
                fit = max((q["batch"] for q in probes if q["fits"]), default=None)
                status = "skipped (below)" if p.get("reason") else _status(run)
                rows.append([run["name"], f"≥ {fit} (global)" if fit else "—", "—", len(probes), status, _cmd(run)])
        lines += _table(["policy", "largest that fits", "first that does not", "probes", "status", "command"], rows)
        if p.get("reason"):
            lines += ["", f"Skipped: {p['reason']}."]
        lines.append("")
    if "levers" in parts:
        p = parts["levers"]
        lines += [f"## Levers (one per row, against the baseline) — {p['status']}", ""]
        base = (p["runs"][0].get("result") or {}) if p["runs"] else {}
        rows = []
        for run in p["runs"]:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], "—", "—", "—", _status(run), _cmd(run)])
                continue
            vs = (x["samples_per_s_per_device"] / base["samples_per_s_per_device"]) if base.get("samples_per_s_per_device") else None
            rows.append([run["name"], _f(x["samples_per_s_per_device"]), _pct(x["mfu"]),
                         "—" if vs is None else f"{vs:.3f}x", "ok", _cmd(run)])
        lines += _table(["lever", "samples/s per device", "MFU", "vs baseline", "status", "command"], rows)
        lines.append("")
    if "torch" in parts:
        p = parts["torch"]
        lines += [f"## Beside PyTorch (same model and loss, same GPU, same batch) — {p['status']}", ""]
        rows = []
        for run in p["runs"]:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], "—", "—", "—", _status(run), _cmd(run)])
                continue
            mem = x.get("peak_memory_bytes", (x.get("device_memory") or {}).get("peak_bytes_in_use"))
            rows.append([run["name"], _f(x["samples_per_s_per_device"]), _f(x["tflops_per_device"]),
                         _gib(mem), "ok", _cmd(run)])
        lines += _table(["step", "samples/s per device", "TFLOP/s", "peak memory (GiB)", "status", "command"], rows)
        if "ratio" in p:
            lines += ["", f"prolip_jax / PyTorch: **{p['ratio']:.2f}x** samples/s."]
        lines.append("")
    if "e2e" in parts:
        p = parts["e2e"]
        lines += [f"## End to end: the trainer with its input pipeline ({p.get('cpu_count')} CPU cores, global batch "
                  f"{p.get('global_batch')}) — {p['status']}", ""]
        rows = []
        for run in p.get("runs", []):
            x = run.get("result") or {}
            if run["name"] in ("JPEG shards", "tokenizer"):
                continue
            if run["status"] != "ok":
                rows.append([run["name"], "—", "—", _status(run), _cmd(run)])
                continue
            rate = x.get("samples_per_s", x.get("samples_per_s_per_device"))
            note = x.get("vs_random")
            extra = ("" if run.get("random_batch_host_s") is None
                     else f"; host makes a random batch in {run['random_batch_host_s'] * 1e3:.0f} ms")
            rows.append([run["name"], _f(rate), "—" if note is None else f"{note:.2f}x", "ok" + extra, _cmd(run)])
        lines += _table(["input", "samples/s", "vs data.source=random", "status", "command"], rows)
        if p.get("error"):
            lines += ["", f"Failed: {p['error']}"]
        lines.append("")
    if "eval" in parts:
        p = parts["eval"]
        lines += [f"## Evaluation speed — {p['status']}", ""]
        rows = []
        for run in p.get("runs") or []:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], "—", _status(run), _cmd(run)])
            elif "encoder" in x:
                e = x["encoder"]
                rows += [["encoder images/s", _f(e["images_per_s"]), f"{e['image_size']} px, block {e['batch']}",
                          _cmd(run)],
                         ["encoder texts/s", _f(e["texts_per_s"]), f"{e['context_length']} tokens, block "
                          f"{e['batch']}", _cmd(run)]]
            elif "csd" in x:
                c = x["csd"]
                peak = (c.get("device_memory") or {}).get("peak_bytes_in_use")
                rows.append([f"blocked CSD ranks, {c['queries']} x {c['gallery']}", f"{_f(c['seconds'])} s",
                             f"dim {c['dim']}, block {c['block']}; device peak {_gib(peak)} GiB, host peak RSS "
                             f"{_gib(c['host_peak_rss_bytes'])} GiB", _cmd(run)])
        if rows:
            lines += _table(["what", "value", "notes", "command"], rows)
        else:
            lines += [p.get("error") or p.get("reason") or p["status"]]
        lines.append("")
    return "\n".join(lines)


def merge(files: list[str]) -> dict:
    """One results dict from several runs of parts of the plan: a part's runs are joined by
    name (a later file's run of the same name wins, unless it was not run)."""
    merged: dict[str, Any] = {"parts": {}, "merged_from": []}
    for f in files:
        r = json.loads(Path(f).read_text())
        merged["merged_from"].append({"file": f, "command": r.get("command"), "date": r.get("date")})
        for key in ("environment", "plan", "date"):
            if r.get(key) is not None:
                merged.setdefault(key, r[key])
        for name, part in r.get("parts", {}).items():
            old = merged["parts"].get(name)
            if old is None:
                merged["parts"][name] = part
                continue
            runs = {x["name"]: x for x in old.get("runs", [])}
            for x in part.get("runs", []):
                if x["status"] != "not run" or x["name"] not in runs:
                    runs[x["name"]] = x
            merged["parts"][name] = {**old, **part, "runs": list(runs.values())}
            if runs:
                merged["parts"][name]["status"] = part_status(list(runs.values()))
    merged["command"] = "; ".join(m["command"] or "" for m in merged["merged_from"])
    merged["parts"] = {k: merged["parts"][k] for k in PARTS if k in merged["parts"]}
    return merged
