"""The README is the front door: short, linked, and every command in it true.

Checked here: its length and table of contents; every relative link of the README and docs/
resolves; no commit hashes or internal file numbers; every command's script, config file, flag,
`--config.<knob>` override and make target exists, in the README and in docs/; and the commands
that fit CI run with small stand-ins (the Python API example against a tiny checkpoint; the
scripts' `--help`; docs/data.md's own-data recipe in tests/test_docs_commands.py).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

from prolip_jax.runtime import config_args

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEXT = README.read_text()
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "benchmarks" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    s = re.sub(r"[`*_]", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def headings(text: str) -> set[str]:
    out, in_code = set(), False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def commands(text: str) -> list[str]:
    """Shell commands of the ```bash blocks: continuation lines joined, comments dropped."""
    out = []
    for block in code_blocks(text, "bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                out.append(line)
    return out


def test_readme_is_short_with_a_table_of_contents():
    lines = TEXT.splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines (at most 300: move detail to docs/)"
    assert "## Contents" in TEXT
    anchors = headings(TEXT)
    toc = TEXT.split("## Contents", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(#([^)]+)\)", toc)
    assert len(links) >= 6
    assert [a for a in links if a not in anchors] == []


def test_readme_has_no_history_commit_hashes_or_internal_names():
    prose = re.sub(r"```.*?```", "", TEXT, flags=re.S)
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert hashes == []
    assert not re.search(r"\bseeds? 00\d|REFERENCE §|issue \d+", TEXT)
    assert "<!--" not in TEXT, "a placeholder is left in the README"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    text = doc.read_text()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+://|^mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in headings(dest.read_text()):
            bad.append(target)
    assert bad == []


def _config_args_ok(spec: str) -> None:
    """configs/X.py[:args] exists and loads with its args (ml_collections only, no jax)."""
    path = spec.partition(":")[0]
    assert (ROOT / path).exists(), f"README names {path}, which does not exist"


@lru_cache(maxsize=None)
def script_help(script: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"{script} --help failed: {r.stderr[-500:]}"
    return r.stdout


@lru_cache(maxsize=None)
def train_config(spec: str):
    """The ConfigDict of `configs/X.py[:arg]`, loaded as the trainer loads it (get_config(arg))."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_readme_config", ROOT / path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _has_knob(config, dotted: str) -> bool:
    node = config
    for part in dotted.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, AttributeError):
            return False
    return True


def _declared_knob(spec: str, dotted: str) -> bool:
    """A field the trainer's help lists for `spec`: set by the file or declared with a default."""
    from prolip_jax.runtime import train_flags

    listed = {name.split(" ")[0]: fields for name, fields in train_flags.config_fields(f"{ROOT}/{spec}")}
    parts = dotted.split(".")
    return (parts[0] in listed["top"] or len(parts) > 1 and parts[1] in listed.get(parts[0] + ".", ())
            or len(parts) > 2 and parts[2] in listed.get(f"{parts[0]}.{parts[1]}.", ()))


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_names_things_that_exist(doc):
    """The README's and docs/'s commands: scripts, flags, configs, `--config.<knob>`s, make targets."""
    makefile = (ROOT / "Makefile").read_text()
    checked = 0
    for cmd in commands(doc.read_text()):
        argv = shlex.split(cmd.split("|")[0])
        env_free = [a for a in argv if not re.match(r"^[A-Z_]+=", a)]
        if not env_free:
            continue
        head = env_free[0]
        if head == "make":
            for target in env_free[1:]:
                if "=" not in target:
                    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"make {target}"
            checked += 1
        elif head in ("python", "python3") and len(env_free) > 1:
            if env_free[1] == "-m":
                assert env_free[2] == "prolip_jax.train", cmd
                flags = {a.split("=", 1)[0]: a.split("=", 1)[1] if "=" in a else None
                         for a in env_free[3:] if a.startswith("--")}
                config = env_free[env_free.index("--config") + 1] if "--config" in env_free else None
                if config:
                    _config_args_ok(config)
                    cfg = train_config(config)
                    for flag in flags:
                        if flag.startswith("--config."):
                            knob = flag[len("--config."):]
                            assert _has_knob(cfg, knob) or _declared_knob(config, knob), \
                                f"{flag} is no knob of {config}: {cmd}"
            else:
                script = env_free[1]
                if script.startswith("-c"):
                    continue
                assert (ROOT / script).exists(), f"{doc.name} runs {script}, which does not exist"
                if script.endswith(".py"):
                    text = script_help(script)
                    config = env_free[env_free.index("--config") + 1] if "--config" in env_free else ""
                    for a in env_free[2:]:
                        if a.startswith("--config.") and config.startswith("configs/"):
                            config_args.check_overrides(config_args.load_config_file(f"{ROOT}/{config}"), [a])
                        elif a.startswith("--"):
                            assert a.split("=", 1)[0] in text, f"{script} has no flag {a}: {cmd}"
                        elif a.startswith("configs/"):
                            _config_args_ok(a)
            checked += 1
        elif head.startswith(("scripts/", "benchmarks/", "bash", "sbatch")):
            script = env_free[1] if head in ("bash", "sbatch") else head
            assert (ROOT / script.split()[0]).exists(), f"{doc.name} runs {script}"
            checked += 1
    assert checked >= 8 or doc != README, f"only {checked} commands checked: did the README lose its ```bash blocks?"


def _word_tokenizer_file(words: list[str]):
    """A word-level tokenizer.json (the `tokenizers` library, as the demo's), ids < 1000, as a
    recorded TokenizerFile of kind "hf": pad = EOS = 1."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from input_pipeline.tokenizer_files import TokenizerFile

    vocab = {"[UNK]": 0, "[EOS]": 1, "[MASK]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return TokenizerFile("hf", tok.to_str().encode(), dict(clean=None, pad_id=1, eos_id=1, context_length=16),
                         None, ())


def test_the_python_api_example_runs_as_written(tmp_path, golden_params, golden_config, monkeypatch):
    """The README's Python block, with its path pointed at an exported folder of the golden
    fixture's model that carries a tokenizer (the demo's workdir is not trained in CI)."""
    from prolip_jax import export

    (block,) = code_blocks(TEXT, "python")
    assert len(block.strip().splitlines()) <= 15
    words = "a an the red blue green circle square photo of".split()
    folder = export.save_hf(tmp_path / "model", golden_params, golden_config,
                            tokenizer=_word_tokenizer_file(words), normalization="openai")
    assert '"workdirs/demo"' in block
    printed = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: printed.append(a))
    namespace = {}
    exec(compile(block.replace('"workdirs/demo"', repr(str(folder))), "README.md", "exec"), namespace)
    logits, probs, sigma2 = namespace["logits"], namespace["probs"], namespace["sigma2"]
    assert logits.shape == (2, 2) and probs.shape == (2, 2) and sigma2.shape == (2,)
    assert abs(probs.sum(-1) - 1).max() < 1e-5 and printed
