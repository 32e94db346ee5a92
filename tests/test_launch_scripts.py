"""scripts/launch_tpu_pod.sh and scripts/launch_slurm.sh against stub gcloud / SLURM commands.

The stubs sit first on PATH, log their argv (one line per call, arguments split by \\x1f) and
print canned output; `USER` is unset, as in a bare cron or container shell. No network, no jax.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TPU = ROOT / "scripts" / "launch_tpu_pod.sh"
SLURM = ROOT / "scripts" / "launch_slurm.sh"
SEP = "\x1f"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# What gcloud prints on stderr (exit status 1) when `tpu-vm describe` finds no such VM.
NOT_FOUND = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND: Resource "
             "'projects/proj-1/locations/us-east5-a/nodes/prolip-v5p' was not found. This command is "
             "authenticated as me@example.com which is the active account specified by the [core/account] property\n"
             "- '@type': type.googleapis.com/google.rpc.ResourceInfo\n"
             "  resourceName: projects/proj-1/locations/us-east5-a/nodes/prolip-v5p")

# Every stub logs its argv; the ones below also answer.
LOG = 'log() { local IFS=$\'\\x1f\'; printf \'%s\\n\' "$(basename "$0")$IFS$*" >> "$STUB_LOG"; }; log "$@"\n'
STUBS = {
    # describe: STUB_DESCRIBE_ERR fails with that stderr; else the n-th call answers the n-th word of
    # STUB_TPU_STATE (the last one repeats; NOT_FOUND: no such VM); unset: no such VM.
    "gcloud": LOG + r'''
case " $* " in
  *" describe "*) if [ -n "${STUB_DESCRIBE_ERR:-}" ]; then printf '%s\n' "$STUB_DESCRIBE_ERR" >&2; exit 1; fi
                  read -ra states <<< "${STUB_TPU_STATE:-NOT_FOUND}"
                  n=$(grep -c $'\x1fdescribe\x1f' "$STUB_LOG")
                  state=${states[$((n <= ${#states[@]} ? n - 1 : ${#states[@]} - 1))]}
                  if [ "$state" != NOT_FOUND ]; then echo "$state"; exit 0; fi
                  printf '%s\n' "$STUB_NOT_FOUND" >&2; exit 1 ;;
  *" ssh "*) for ((w = 0; w < ${STUB_WORKERS:-1}; w++)); do echo "t1v-worker-$w: ok"; done ;;
esac
''',
    "sbatch": LOG + 'echo "Submitted batch job 4242"\n',
    "squeue": LOG + 'if [ -n "${STUB_SQUEUE:-}" ]; then echo "$STUB_SQUEUE"; fi\n',
    "scancel": LOG,
    "ssh": LOG,
    "scontrol": LOG + r'''
if [ "$1 $2" = "show hostnames" ]; then tr ',' '\n' <<< "$STUB_HOSTS"; fi
''',
    # Starts the command after srun's options once per task, as srun would, with the task's ids.
    "srun": LOG + r'''
while [[ $1 == --* ]]; do shift; done
if [ -n "${STUB_SRUN_SLEEP:-}" ]; then
  trap 'printf "srun\x1fgot TERM\n" >> "$STUB_LOG"; kill $! 2>/dev/null; exit 0' TERM
  sleep "$STUB_SRUN_SLEEP" & wait; exit 0
fi
for ((t = 0; t < SLURM_NTASKS; t++)); do SLURM_PROCID=$t SLURM_LOCALID=$((t % 8)) "$@"; done
''',
}


def _calls(log: Path) -> list[list[str]]:
    if not log.exists():
        return []
    return [line.split(SEP) for line in log.read_text().splitlines()]


@pytest.fixture
def env(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, body in STUBS.items():
        path = stubs / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    return {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(home), "STUB_LOG": str(tmp_path / "calls.log"),
            "LANG": "C.UTF-8", "STUB_NOT_FOUND": NOT_FOUND}  # no USER, on purpose


def _run(script: Path, env: dict, *args: str, **extra: str) -> subprocess.CompletedProcess:
    assert "USER" not in env
    return subprocess.run(["bash", str(script), *args], env={**env, **extra}, capture_output=True,
                          text=True, timeout=60, cwd=env["HOME"])


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _settings(script: Path) -> list[str]:
    match = re.search(r"^SETTINGS=\(([^)]*)\)", script.read_text(), re.M)
    return match.group(1).split()


# ---- TPU pod -------------------------------------------------------------------------------------

POD = {"TPU_NAME": "prolip-v5p", "ZONE": "us-east5-a", "PROJECT": "proj-1", "ACCELERATOR_TYPE": "v5p-64",
       "WORKDIR": "gs://bkt/prolip/run1", "DATA_PATH": "gs://bkt/data/{00000..00099}.tar"}


@pytest.fixture
def tokenizer(tmp_path):
    path = tmp_path / "spiece.model"
    path.write_bytes(b"sentencepiece stand-in")
    return str(path)


def _gcloud(calls, verb):
    return [c for c in calls if c[0] == "gcloud" and verb in c]


def _command(call):
    (cmd,) = [a[len("--command="):] for a in call if a.startswith("--command=")]
    return cmd


def test_tpu_missing_settings_is_one_line_naming_them(env):
    proc = _run(TPU, env)
    line = _one_error_line(proc)
    for name in ("TPU_NAME", "ZONE", "PROJECT", "ACCELERATOR_TYPE", "WORKDIR", "DATA_PATH", "TOKENIZER"):
        assert name in line
    assert "unbound" not in proc.stderr and "my-gcp-project" not in proc.stdout + proc.stderr
    assert _calls(Path(env["STUB_LOG"])) == []

    partial = {k: v for k, v in POD.items() if k != "WORKDIR"}
    line = _one_error_line(_run(TPU, env, **partial))
    assert "missing settings: WORKDIR, TOKENIZER" in line
    # watching or stopping needs only the VM's address
    line = _one_error_line(_run(TPU, env, "stop", TPU_NAME="x"))
    assert "missing settings: ZONE, PROJECT (" in line


def test_tpu_help_lists_every_setting_and_the_doc_too(env):
    proc = _run(TPU, env, "--help")
    assert proc.returncode == 0
    doc = (ROOT / "docs" / "launch.md").read_text()
    for name in _settings(TPU):
        assert re.search(rf"\b{name}\b", proc.stdout), name
        assert name in doc, name
    for sub in ("launch", "resume", "logs", "status", "stop", "delete"):
        assert re.search(rf"^  {sub}\b", proc.stdout, re.M), sub


def test_tpu_dry_run_prints_every_command_and_runs_none(env, tokenizer):
    proc = _run(TPU, env, "--dry-run", "--", "--config.total_steps=1000", **POD, TOKENIZER=tokenizer)
    assert proc.returncode == 0, proc.stderr
    assert _calls(Path(env["STUB_LOG"])) == []
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("+ ")]
    assert [ln.split()[1:5] for ln in lines if ln.startswith("+ gcloud")] == [
        ["gcloud", "compute", "tpus", "tpu-vm"]] * 6
    verbs = [ln.split()[5] for ln in lines if ln.startswith("+ gcloud")]
    assert verbs == ["describe", "create", "scp", "scp", "ssh", "ssh"]
    assert "--accelerator-type=v5p-64 --version=v2-alpha-tpuv5" in proc.stdout
    assert "# if the TPU VM does not exist yet (one that is PREEMPTED or TERMINATED is deleted first):" in proc.stdout
    assert any(ln.startswith("+ git -C") and " archive " in ln for ln in lines)
    assert "--config.total_steps=1000" in lines[-1] and "nothing was run" in proc.stdout


def test_tpu_launch_creates_ships_installs_and_starts_detached_on_all_workers(env, tokenizer):
    proc = _run(TPU, env, **POD, TOKENIZER=tokenizer, STUB_WORKERS="8")
    assert proc.returncode == 0, proc.stderr
    calls = _calls(Path(env["STUB_LOG"]))
    assert [c[4] for c in calls] == ["describe", "create", "scp", "scp", "ssh", "ssh"]
    create = _gcloud(calls, "create")[0]
    assert {"--accelerator-type=v5p-64", "--version=v2-alpha-tpuv5", "--zone=us-east5-a",
            "--project=proj-1"} <= set(create)
    # a v5p-64 has 8 hosts: every copy and command goes to all of them
    for call in _gcloud(calls, "scp") + _gcloud(calls, "ssh"):
        assert "--worker=all" in call, call
    code, tok = _gcloud(calls, "scp")
    assert code[5].endswith("prolip-code.tar.gz") and code[6] == "prolip-v5p:prolip-code.tar.gz"
    assert tok[5:7] == [tokenizer, "prolip-v5p:prolip-tokenizer-spiece.model"]
    setup, start = (_command(c) for c in _gcloud(calls, "ssh"))
    assert "uv venv -q --python 3.11 ~/prolip/venv" in setup
    assert "-c requirements/constraints.txt -e '.[tpu]' gcsfs google-cloud-storage" in setup
    assert "mv -f ~/prolip-tokenizer-spiece.model ~/prolip/assets/spiece.model" in setup
    assert "a run is still alive" in setup  # refuses to start a second run over a live one
    assert "PROLIP_DISTRIBUTED=1 setsid nohup ~/prolip/venv/bin/python -m prolip_jax.train" in start
    assert ">> ~/prolip/logs/train.log 2>&1 < /dev/null & echo $! > ~/prolip/train.pid" in start
    assert "--workdir=gs://bkt/prolip/run1" in start
    assert '--config.data.tokenizer.path="$HOME/prolip/assets/spiece.model"' in start
    assert proc.stdout.count("t1v-worker-") == 16  # the stub's 8 workers answered both ssh calls
    assert "launch_tpu_pod.sh logs" in proc.stdout and "launch_tpu_pod.sh stop" in proc.stdout


def test_tpu_resume_reuses_the_vm_and_keeps_the_workdir(env):
    starts = []
    for sub in ("launch", "resume"):
        proc = _run(TPU, env, sub, **POD, TOKENIZER="gs://bkt/tok/spiece.model", STUB_TPU_STATE="READY")
        assert proc.returncode == 0, proc.stderr
        assert "reusing TPU VM prolip-v5p" in proc.stdout
        calls = _calls(Path(env["STUB_LOG"]))
        Path(env["STUB_LOG"]).unlink()
        assert not _gcloud(calls, "create")
        assert len(_gcloud(calls, "scp")) == 1  # the code only: a gs:// tokenizer is passed as is
        starts.append(_command(_gcloud(calls, "ssh")[-1]))
    assert starts[0] == starts[1]
    assert "--workdir=gs://bkt/prolip/run1" in starts[0]
    assert "--config.data.tokenizer.path=gs://bkt/tok/spiece.model" in starts[0]


def test_tpu_multislice_through_queued_resources(env, tokenizer):
    """NUM_SLICES=2: one queued resource of 2 nodes (waited for while it is provisioned), the code,
    tokenizer, setup and trainer on every host of both slices, the data axis across them;
    status/stop reach both slices, delete takes the queued resource."""
    ms = {**POD, "NUM_SLICES": "2", "TPU_NAME": "prolip-ms", "ACCELERATOR_TYPE": "v5p-128"}
    proc = _run(TPU, env, **ms, TOKENIZER=tokenizer, STUB_TPU_STATE="NOT_FOUND", POLL_INTERVAL="0")
    assert proc.returncode == 0, proc.stderr
    calls = _calls(Path(env["STUB_LOG"]))
    Path(env["STUB_LOG"]).unlink()
    [create] = _gcloud(calls, "create")
    assert create[1:5] == ["compute", "tpus", "queued-resources", "create"] and create[5] == "prolip-ms"
    assert {"--node-count=2", "--node-prefix=prolip-ms", "--accelerator-type=v5p-128",
            "--runtime-version=v2-alpha-tpuv5"} <= set(create)
    assert _gcloud(calls, "describe")[0][1:4] == ["compute", "tpus", "queued-resources"]
    assert [c[6].split(":")[0] for c in _gcloud(calls, "scp")] == ["prolip-ms-0", "prolip-ms-1"] * 2
    ssh = _gcloud(calls, "ssh")
    assert [c[5] for c in ssh] == ["prolip-ms-0", "prolip-ms-1"] * 2 and all("--worker=all" in c for c in ssh)
    for start in (_command(c) for c in ssh[2:]):
        assert r"--config.mesh.dcn_shape=\(2\,1\,1\)" in start and "PROLIP_DISTRIBUTED=1" in start
    assert "--config.mesh.dcn_shape" not in _command(ssh[0])

    # Provisioned over two state checks, then reused as it is ACTIVE; dry run: both slices' commands.
    proc = _run(TPU, env, **ms, TOKENIZER=tokenizer, STUB_TPU_STATE="WAITING_FOR_RESOURCES ACTIVE",
                POLL_INTERVAL="0")
    assert proc.returncode == 0, proc.stderr
    assert "is WAITING_FOR_RESOURCES: waiting" in proc.stdout and "reusing TPU VM prolip-ms (ACTIVE)" in proc.stdout
    Path(env["STUB_LOG"]).unlink()
    for sub, verb in (("status", "ssh"), ("stop", "ssh"), ("delete", "delete")):
        assert _run(TPU, env, sub, **ms).returncode == 0
        calls = _calls(Path(env["STUB_LOG"]))
        Path(env["STUB_LOG"]).unlink()
        if verb == "ssh":
            assert [c[5] for c in calls] == ["prolip-ms-0", "prolip-ms-1"], sub
        else:
            assert calls[0][1:6] == ["compute", "tpus", "queued-resources", "delete", "prolip-ms"]
            assert "--force" in calls[0]
    line = _one_error_line(_run(TPU, env, **{**ms, "NUM_SLICES": "two"}, TOKENIZER=tokenizer))
    assert "NUM_SLICES=two: a whole number of slices" in line


def test_tpu_refusals(env, tokenizer):
    line = _one_error_line(_run(TPU, env, **POD, TOKENIZER="/nowhere/spiece.model"))
    assert "neither a gs:// path nor a local file" in line
    line = _one_error_line(_run(TPU, env, "--zonee=x", **POD, TOKENIZER=tokenizer))
    assert "unknown option --zonee" in line
    line = _one_error_line(_run(TPU, env, **{**POD, "ACCELERATOR_TYPE": "v9z-8"}, TOKENIZER=tokenizer))
    assert "RUNTIME_VERSION" in line
    line = _one_error_line(_run(TPU, env, **POD, TOKENIZER=tokenizer, READY_TIMEOUT="30m"))
    assert "READY_TIMEOUT=30m" in line
    # array_record cannot stream from a bucket (docs/buckets.md): refused before any cloud call.
    line = _one_error_line(_run(TPU, env, **{**POD, "DATA_PATH": "gs://bkt/ar/*.array_record"}, TOKENIZER=tokenizer))
    assert "must be on each worker's local disk" in line and "DATA_SOURCE=tar" in line
    assert not _gcloud(_calls(Path(env["STUB_LOG"])), "create")


# What gcloud prints on stderr (exit status 1) when describe fails for another reason than a missing VM.
NO_ACCOUNT = """ERROR: (gcloud.compute.tpus.tpu-vm.describe) You do not currently have an active account selected.
Please run:

  $ gcloud auth login

to obtain new credentials.

If you have already logged in with a different account, run:

  $ gcloud config set account ACCOUNT

to select an already authenticated account to use."""
DENIED = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) PERMISSION_DENIED: Permission 'tpu.nodes.get' denied on "
          "'projects/proj-1/locations/us-east5-a/nodes/prolip-v5p'. This command is authenticated as "
          "me@example.com which is the active account specified by the [core/account] property")
NO_PROJECT = ("ERROR: (gcloud.compute.tpus.tpu-vm.describe) PERMISSION_DENIED: Project 'projects/proj-1' "
              "not found or permission denied.")


@pytest.mark.parametrize("err", [NO_ACCOUNT, DENIED, NO_PROJECT], ids=["no-account", "denied", "no-project"])
def test_tpu_describe_failure_stops_before_creating(env, tokenizer, err):
    proc = _run(TPU, env, **POD, TOKENIZER=tokenizer, STUB_DESCRIBE_ERR=err)
    line = _one_error_line(proc)
    assert err.splitlines()[0] in line  # gcloud's own first line
    assert "gcloud auth login" in line and "PROJECT=proj-1" in line and "ZONE=us-east5-a" in line
    assert [c[4] for c in _calls(Path(env["STUB_LOG"]))] == ["describe"]  # nothing created, nothing shipped


@pytest.mark.parametrize("state", ["PREEMPTED", "TERMINATED"])
@pytest.mark.parametrize("sub", ["launch", "resume"])
def test_tpu_preempted_vm_is_deleted_and_created_anew(env, tokenizer, sub, state):
    proc = _run(TPU, env, sub, **POD, TOKENIZER=tokenizer, SPOT="1", STUB_TPU_STATE=state)
    assert proc.returncode == 0, proc.stderr
    assert f"is {state}" in proc.stdout and "creating it anew" in proc.stdout
    calls = _calls(Path(env["STUB_LOG"]))
    assert [c[4] for c in calls] == ["describe", "delete", "create", "scp", "scp", "ssh", "ssh"]
    assert calls[1][5] == "prolip-v5p" and "--quiet" in calls[1]
    assert {"--accelerator-type=v5p-64", "--spot"} <= set(calls[2])
    assert "--workdir=gs://bkt/prolip/run1" in _command(calls[-1])  # the same WORKDIR: the run resumes


def test_tpu_waits_for_a_vm_on_its_way_to_ready(env, tokenizer):
    proc = _run(TPU, env, **POD, TOKENIZER=tokenizer, STUB_TPU_STATE="CREATING CREATING READY", POLL_INTERVAL="0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("is CREATING: waiting") == 1 and "reusing TPU VM prolip-v5p" in proc.stdout
    assert [c[4] for c in _calls(Path(env["STUB_LOG"]))] == ["describe"] * 3 + ["scp", "scp", "ssh", "ssh"]
    # one being deleted: once it is gone, a new one is created
    Path(env["STUB_LOG"]).unlink()
    proc = _run(TPU, env, **POD, TOKENIZER=tokenizer, STUB_TPU_STATE="DELETING NOT_FOUND", POLL_INTERVAL="0")
    assert proc.returncode == 0, proc.stderr
    assert [c[4] for c in _calls(Path(env["STUB_LOG"]))][:3] == ["describe", "describe", "create"]


def test_tpu_wait_for_ready_is_bounded(env, tokenizer):
    proc = _run(TPU, env, **POD, TOKENIZER=tokenizer, STUB_TPU_STATE="CREATING", READY_TIMEOUT="1",
                POLL_INTERVAL="0.1")
    line = _one_error_line(proc)
    assert "still CREATING after 1 s" in line and "READY_TIMEOUT" in line and "delete" in line
    calls = _calls(Path(env["STUB_LOG"]))
    assert len(calls) >= 2 and {c[4] for c in calls} == {"describe"}


@pytest.mark.parametrize("state, hint", [("STOPPED", "tpu-vm start prolip-v5p"), ("HIDDEN", "delete")])
def test_tpu_wait_stops_at_once_on_a_state_that_never_becomes_ready(env, tokenizer, state, hint):
    start = time.monotonic()
    proc = _run(TPU, env, **POD, TOKENIZER=tokenizer, STUB_TPU_STATE=f"CREATING {state}", READY_TIMEOUT="600",
                POLL_INTERVAL="0")
    line = _one_error_line(proc)
    assert f"is {state}" in line and hint in line
    assert time.monotonic() - start < 30
    assert [c[4] for c in _calls(Path(env["STUB_LOG"]))] == ["describe", "describe"]


def test_tpu_data_source_follows_the_shard_names(env, tokenizer):
    proc = _run(TPU, env, "--dry-run", **POD, TOKENIZER=tokenizer)
    assert proc.returncode == 0 and "--config.data.source=tar" in proc.stdout


def test_tpu_watch_stop_delete_address_the_vm(env):
    where = {k: POD[k] for k in ("TPU_NAME", "ZONE", "PROJECT")}
    assert _run(TPU, env, "logs", "--worker=3", **where).returncode == 0
    assert _run(TPU, env, "stop", **where).returncode == 0
    assert _run(TPU, env, "status", **where).returncode == 0
    assert _run(TPU, env, "delete", **where).returncode == 0
    logs, stop, status, delete = _calls(Path(env["STUB_LOG"]))
    assert "--worker=3" in logs and "tail -n 100 -F ~/prolip/logs/train.log" in _command(logs)
    assert "--worker=all" in stop and 'kill -TERM "$(cat ~/prolip/train.pid)"' in _command(stop)
    assert "--worker=all" in status
    assert delete[4:6] == ["delete", "prolip-v5p"] and "--quiet" in delete


# A stand-in worker: `ssh --command` runs in bash with HOME=<worker home>, `scp` copies there, and
# uv / the venv's python are stubs (python logs its argv, then waits for SIGTERM like the trainer).
WORKER_GCLOUD = LOG + r'''
case " $* " in
  *" describe "*) echo READY ;;
  *" scp "*) cp "$5" "$SIM_HOME/${6#*:}" ;;
  *" ssh "*) for a in "$@"; do [[ $a == --command=* ]] && cmd=${a#--command=}; done
             HOME=$SIM_HOME PATH="$SIM_BIN:/usr/bin:/bin" bash -c "cd; $cmd" ;;
esac
'''
WORKER_UV = r'''#!/usr/bin/env bash
if [ "$1" = venv ]; then
  mkdir -p "${@: -1}/bin"; py="${@: -1}/bin/python"
  printf '%s\n' '#!/usr/bin/env bash' "trap 'echo TERM >> \"\$HOME/python.log\"; kill \$!; exit 0' TERM" \
    'printf "%s\x1f" "$@" >> "$HOME/python.log"; echo >> "$HOME/python.log"; sleep 30 & wait' > "$py"
  chmod +x "$py"
fi
echo "uv $*" >> "$HOME/uv.log"
'''


def test_tpu_remote_commands_run_on_a_worker(env, tokenizer, tmp_path):
    (Path(env["PATH"].split(":")[0]) / "gcloud").write_text("#!/usr/bin/env bash\n" + WORKER_GCLOUD)
    home, wbin = tmp_path / "worker", tmp_path / "worker-bin"
    home.mkdir(), wbin.mkdir()
    (wbin / "uv").write_text(WORKER_UV)
    (wbin / "uv").chmod(0o755)
    sim = {**env, "SIM_HOME": str(home), "SIM_BIN": str(wbin)}
    args = ("--", "--config.run_name=a b", "--config.data.path=gs://x/{0..3}.tar")
    proc = _run(TPU, sim, *args, **POD, TOKENIZER=tokenizer)
    assert proc.returncode == 0, proc.stderr
    assert (home / "prolip" / "assets" / "spiece.model").read_bytes() == b"sentencepiece stand-in"
    assert (home / "prolip" / "code" / "requirements" / "constraints.txt").is_file()
    assert "--python 3.11" in (home / "uv.log").read_text()
    pid = int((home / "prolip" / "train.pid").read_text())
    deadline = time.monotonic() + 10
    while not (home / "python.log").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    argv = (home / "python.log").read_text().splitlines()[0].split(SEP)
    assert argv[:2] == ["-m", "prolip_jax.train"]
    assert {"--workdir=gs://bkt/prolip/run1", "--config.run_name=a b", "--config.data.path=gs://x/{0..3}.tar",
            f"--config.data.tokenizer.path={home}/prolip/assets/spiece.model"} <= set(argv)
    try:
        # a second launch over the live run is refused; stop sends SIGTERM; then status says so
        again = _run(TPU, sim, **POD, TOKENIZER=tokenizer)
        assert again.returncode != 0 and "a run is still alive" in again.stderr
        stop = _run(TPU, sim, "stop", **POD)
        assert "stopping" in stop.stdout
        while "TERM" not in (home / "python.log").read_text():
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
        time.sleep(0.2)
        assert "not running" in _run(TPU, sim, "status", **POD).stdout
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- SLURM ---------------------------------------------------------------------------------------

RUN = {"WORKDIR": "/shared/prolip/run1", "DATA_PATH": "/data/dc/*.array_record",
       "TOKENIZER": "/data/spiece.model", "GPUS_PER_NODE": "8", "NODES": "2"}


@pytest.fixture
def venv(tmp_path):
    """A stand-in CUDA environment whose python logs its argv and the task's ids."""
    python = tmp_path / "venv-cuda" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/usr/bin/env bash\n" + LOG.replace('$(basename "$0")', "python"))
    python.chmod(0o755)
    return str(python.parent.parent)


def test_slurm_missing_settings_is_one_line_naming_them(env):
    proc = _run(SLURM, env)
    line = _one_error_line(proc)
    assert "missing settings: WORKDIR, DATA_PATH, TOKENIZER, GPUS_PER_NODE" in line
    assert "unbound" not in proc.stderr
    assert _calls(Path(env["STUB_LOG"])) == []
    line = _one_error_line(_run(SLURM, env, **{**RUN, "NODES": "two"}))
    assert "NODES=two" in line


def test_slurm_help_lists_every_setting_and_the_doc_too(env):
    proc = _run(SLURM, env, "--help")
    assert proc.returncode == 0
    doc = (ROOT / "docs" / "launch.md").read_text()
    for name in _settings(SLURM):
        assert re.search(rf"\b{name}\b", proc.stdout), name
        assert name in doc, name


def test_slurm_submit_needs_the_cuda_environment(env):
    line = _one_error_line(_run(SLURM, env, **RUN, VENV="/nowhere/venv"))
    assert "VENV=/nowhere/venv" in line and "setup" in line


def test_slurm_setup_builds_the_cuda_extra(env, tmp_path):
    proc = _run(SLURM, env, "setup", "--dry-run", PYTHON="python3.11", VENV=str(tmp_path / "v"))
    assert proc.returncode == 0, proc.stderr
    assert f"+ python3.11 -m venv {tmp_path / 'v'}" in proc.stdout
    assert (f"+ {tmp_path / 'v'}/bin/python -m pip install -q -c {ROOT}/requirements/constraints-cuda.txt "
            f"-e '{ROOT}[cuda]'") in proc.stdout


# A stand-in Python of a given version: answers -V and setup's version check.
PYTHON_STUB = r"""#!/usr/bin/env bash
v=%s
case $1 in
  -V) echo "Python $v" ;;
  -c) IFS=. read -r major minor _ <<< "$v"; ((major > 3 || (major == 3 && minor >= 11))) ;;
esac
"""


@pytest.mark.parametrize("pythons, picked", [
    ({"python3.13": "3.13.1", "python3.12": "3.12.3", "python3.11": "3.11.9", "python3": "3.13.1"}, "python3.11"),
    ({"python3.13": "3.13.1", "python3.12": "3.12.3", "python3": "3.12.3"}, "python3"),
    ({"python3.13": "3.13.1", "python3": "3.10.12"}, "no python3.11 on PATH and python3 is Python 3.10.12"),
    ({}, "no python3.11 or python3 on PATH"),
], ids=["3.11-first", "python3-if-3.11-or-newer", "python3-too-old", "none"])
def test_slurm_setup_picks_python_3_11_as_the_lock_and_the_makefile(env, tmp_path, pythons, picked):
    # PATH: these stubs and every system command but the host's own pythons
    stubs, system = tmp_path / "pythons", tmp_path / "system"
    stubs.mkdir(), system.mkdir()
    for folder in ("/usr/bin", "/bin"):
        for name in os.listdir(folder):
            if not name.startswith("python") and not (system / name).exists():
                (system / name).symlink_to(Path(folder) / name)
    for name, version in pythons.items():
        (stubs / name).write_text(PYTHON_STUB % version)
        (stubs / name).chmod(0o755)
    path = f"{env['PATH'].split(':')[0]}:{stubs}:{system}"
    proc = _run(SLURM, {**env, "PATH": path}, "setup", "--dry-run", VENV=str(tmp_path / "v"))
    if picked.startswith("python"):
        assert proc.returncode == 0, proc.stderr
        assert f"+ {picked} -m venv {tmp_path / 'v'}" in proc.stdout
    else:
        line = _one_error_line(proc)
        assert picked in line and "PYTHON=/path/to/python3.11" in line


def test_slurm_submit_and_resubmit(env, venv):
    sbatches = []
    for sub in ("submit", "resume"):
        proc = _run(SLURM, env, sub, "--partition=gpu", "--config.total_steps=100", **RUN, VENV=venv)
        assert proc.returncode == 0, proc.stderr
        calls = _calls(Path(env["STUB_LOG"]))
        Path(env["STUB_LOG"]).unlink()
        assert [c[0] for c in calls] == ["squeue", "sbatch"]  # checks for a live job first
        sbatches.append(calls[1])
    assert sbatches[0] == sbatches[1]  # same WORKDIR: the trainer resumes from its checkpoint
    sb = sbatches[0]
    script = sb.index(str(SLURM))
    assert {"--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--requeue", "--signal=B:USR1@120",
            "--partition=gpu", f"--chdir={ROOT}", "--output=/shared/prolip/run1/slurm/%j-batch.log"} <= set(sb[:script])
    job = sb[script + 1:]
    assert job[0] == "job" and "--workdir=/shared/prolip/run1" in job and f"--venv={venv}" in job
    assert job[job.index("--") + 1:] == ["--config.total_steps=100"]


def test_slurm_refuses_a_second_job_on_the_run(env, venv):
    line = _one_error_line(_run(SLURM, env, **RUN, VENV=venv, STUB_SQUEUE="777"))
    assert "job 777" in line
    assert [c[0] for c in _calls(Path(env["STUB_LOG"]))] == ["squeue"]


def test_slurm_dry_run_prints_sbatch_and_the_job_and_runs_none(env):
    proc = _run(SLURM, env, "--dry-run", **RUN)
    assert proc.returncode == 0, proc.stderr
    assert _calls(Path(env["STUB_LOG"])) == []
    cmds = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("+ ")]
    assert cmds == ["mkdir", "sbatch", "scontrol", "srun", "scontrol"]
    assert "--ntasks-per-node=8" in proc.stdout and "--num_processes=16" in proc.stdout


def _job_env(tmp_path, venv, **extra):
    return dict(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="gpu[01-02]", SLURM_NTASKS="16",
                STUB_HOSTS="gpu01,gpu02", **extra)


def _job_args(venv):
    return ["job", f"--venv={venv}", *(f"--{k.lower().replace('_', '-')}={v}" for k, v in RUN.items()),
            "--", "--config.total_steps=100"]


def test_slurm_job_one_process_per_gpu_with_jax_distributed(env, venv, tmp_path):
    proc = _run(SLURM, env, *_job_args(venv), **_job_env(tmp_path, venv))
    assert proc.returncode == 0, proc.stderr
    calls = _calls(Path(env["STUB_LOG"]))
    assert calls[0] == ["scontrol", "show", "hostnames", "gpu[01-02]"]
    srun = calls[1]
    assert srun[0] == "srun" and "--ntasks-per-node=8" in srun and "--kill-on-bad-exit=1" in srun
    pythons = [c for c in calls if c[0] == "python"]
    assert len(pythons) == 16
    for t, argv in enumerate(pythons):
        assert argv[1:3] == ["-m", "prolip_jax.train"]
        assert {"--coordinator_address=gpu01:21234", "--num_processes=16", f"--process_id={t}",
                "--workdir=/shared/prolip/run1", "--config.total_steps=100"} <= set(argv)
    assert not [c for c in calls if c[:2] == ["scontrol", "requeue"]]


def test_slurm_job_runs_from_a_spool_copy(env, venv, tmp_path):
    """sbatch runs a copy of the script from its spool folder, away from the checkout: the job
    reads launch_common.sh from the checkout that submit passes as --repo-dir."""
    log = Path(env["STUB_LOG"])
    proc = _run(SLURM, env, **RUN, VENV=venv)
    assert proc.returncode == 0, proc.stderr
    sbatch = _calls(log)[-1]
    log.unlink()
    job = sbatch[sbatch.index(str(SLURM)) + 1:]
    assert job[0] == "job" and f"--repo-dir={ROOT}" in job[:job.index("--")]
    spool = tmp_path / "spool" / "job1234" / "slurm_script"
    spool.parent.mkdir(parents=True)
    shutil.copy(SLURM, spool)
    proc = _run(spool, env, *job, **_job_env(tmp_path, venv))
    assert proc.returncode == 0, proc.stderr
    assert len([c for c in _calls(log) if c[0] == "python"]) == 16
    # without it, one line that says what is missing
    line = _one_error_line(_run(spool, env, *_job_args(venv), **_job_env(tmp_path, venv)))
    assert "launch_common.sh" in line and "--repo-dir" in line


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_slurm_job_signal_checkpoints_and_requeues(env, venv, tmp_path, sig, requeued):
    log = Path(env["STUB_LOG"])
    proc = subprocess.Popen(["bash", str(SLURM), *_job_args(venv)], cwd=env["HOME"], text=True,
                            env={**env, **_job_env(tmp_path, venv, STUB_SRUN_SLEEP="30")},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while not any(c[0] == "srun" for c in _calls(log)):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.2)  # srun's stub installs its trap
    proc.send_signal(sig)  # SIGUSR1: the time-limit warning (--signal=B:USR1@120); SIGTERM: preemption
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    calls = _calls(log)
    assert ["srun", "got TERM"] in calls  # passed on: the trainer saves a checkpoint and exits
    assert (["scontrol", "requeue", "1234"] in calls) == requeued
