"""setup.cfg's requirements and extras agree with the pins in requirements/ (no network).

`pip install -c requirements/constraints.txt -e '.[tpu]'` and
`pip install -c requirements/constraints-cuda.txt -e '.[cuda]'` only resolve when every range in
setup.cfg admits the pinned version, and the accelerator extras name jax at exactly the pinned
version (a newer jax[cuda12] would pull a jaxlib the CPU lock does not hold).
"""
from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
CUDA_CONSTRAINTS = ROOT / "requirements" / "constraints-cuda.txt"


def _lines(path: Path) -> list[str]:
    return [ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines() if ln.split("#", 1)[0].strip()]


def _pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a constraints file's `name==version` lines (includes skipped)."""
    pins = {}
    for line in _lines(path):
        if line.startswith("-"):
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {req.name} pinned twice"
        pins[name] = spec.version
    return pins


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _requirements(value: str) -> list[Requirement]:
    return [Requirement(ln) for ln in (x.split("#", 1)[0].strip() for x in value.splitlines()) if ln]


def _extras() -> dict[str, list[Requirement]]:
    section = _setup_cfg()["options.extras_require"]
    return {name: _requirements(section[name]) for name in section}


def test_constraints_parse_as_exact_pins():
    pins = _pins(CONSTRAINTS)
    assert pins["jax"] == pins["jaxlib"], "jax and jaxlib are released together at one version"


@pytest.mark.parametrize("extra, jax_extra", [("tpu", "tpu"), ("cuda", "cuda12")])
def test_accelerator_extras_pin_the_constrained_jax(extra, jax_extra):
    extras = _extras()
    assert extra in extras, f"setup.cfg has no [{extra}] extra"
    (req,) = [r for r in extras[extra] if canonicalize_name(r.name) == "jax"]
    assert req.extras == {jax_extra}
    assert str(req.specifier) == f"=={_pins(CONSTRAINTS)['jax']}", (
        f"setup.cfg [{extra}] has {req}; constraints.txt pins jax=={_pins(CONSTRAINTS)['jax']}")


def test_every_range_admits_the_pinned_version():
    pins = _pins(CONSTRAINTS)
    groups = {"install_requires": _requirements(_setup_cfg()["options"]["install_requires"]), **_extras()}
    checked, refused = 0, []
    for group, reqs in groups.items():
        for req in reqs:
            version = pins.get(canonicalize_name(req.name))
            if version is None:
                continue
            checked += 1
            if not req.specifier.contains(version, prereleases=True):
                refused.append(f"{group}: {req} refuses the pinned {req.name}=={version}")
    assert not refused, "; ".join(refused)
    assert checked >= 20  # the base install's requirements are all pinned


def test_install_requires_are_all_pinned():
    pins = _pins(CONSTRAINTS)
    unpinned = [r.name for r in _requirements(_setup_cfg()["options"]["install_requires"])
                if canonicalize_name(r.name) not in pins]
    assert not unpinned, f"constraints.txt has no pin for {unpinned}"


def test_cuda_constraints_extend_the_base_ones():
    lines = _lines(CUDA_CONSTRAINTS)
    assert "-c constraints.txt" in lines, "constraints-cuda.txt must include the CPU pins"
    base, cuda = _pins(CONSTRAINTS), _pins(CUDA_CONSTRAINTS)
    both = sorted(set(base) & set(cuda))
    assert not both, f"pinned in both files (keep one): {both}"
    # The plugin is released with jax, at the same version.
    assert cuda["jax-cuda12-plugin"] == cuda["jax-cuda12-pjrt"] == base["jax"]
    assert any(name.startswith("nvidia-") for name in cuda)


def test_pin_parser_refuses_a_range(tmp_path):
    bad = tmp_path / "c.txt"
    bad.write_text("jax>=0.4\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        _pins(bad)
