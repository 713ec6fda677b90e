"""Hostile input: config values never become code in generated scripts; bad values are `invalid`
records naming the field and the rule, never a traceback.

The generated-script checks call each framework's dry() directly with a config whose model.name or
job dir is hostile (bypassing validation, which refuses such names: the quoting must hold on its own),
then: `bash -n` every script, parse every Python file and compare its calls with a benign job's, and
execute every run.sh with torchrun / deepspeed / python / srun / run_train.sh replaced by stubs,
asserting that no canary file appeared.
"""
import ast
import json
import importlib
import os
import re
import subprocess

import pytest
from omegaconf import open_dict

from conf.schema import register
from ledger.layout import ConfigError, resolve
from tests.conftest import REPO, launch, compose_config

register()

FRAMEWORKS = ("megatron", "deepspeed", "titan")
STUBS = ("torchrun", "deepspeed", "python", "python3", "srun")

# each one, if it became code, creates the file P (or Q) in the script's working directory
HOSTILE_NAMES = {
    "single_quote": "x' ; touch P ; echo '",
    "newline": "x\ntouch P\n",
    "docstring": 'x""" + __import__("os").system("touch P") + """',
    "repr_break": "x' + __import__('os').system('touch P') + '",
    "subshell": "x$(touch P)",
    "backticks": "x`touch P`",
    "space_quote": 'x y" ; touch P ; "',
}
HOSTILE_DIRS = {
    "semicolon": "t;touch P;",
    "subshell": "t$(touch P)",
    "backticks": "t`touch Q`",
    "space_quote": "a b'\";touch P;'",
}


_compose = compose_config


_BASE = {}


def _cfg(framework: str, name: str | None = None):
    if framework not in _BASE:
        _BASE[framework] = _compose(f"framework={framework}", "mode=dry", "layout.dp=2")
    cfg = _BASE[framework].copy()
    if name is not None:
        with open_dict(cfg):
            cfg.model.name = name
    return cfg


def _dry(framework: str, cfg, job_dir: str) -> list[str]:
    os.makedirs(job_dir, exist_ok=True)
    mod = importlib.import_module(f"launchers.{'titan' if framework == 'titan' else framework}")
    return mod.dry(cfg, resolve(cfg.layout, 2), job_dir)


def _calls(path: str) -> list[str]:
    """Every call in a Python file, as source text of the callee (sorted): a call that a value
    smuggled in would show up here."""
    tree = ast.parse(open(path).read(), filename=path)
    return sorted(ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call))


def _stub_path(tmp) -> str:
    d = tmp / "stubs"
    d.mkdir(exist_ok=True)
    for s in STUBS:
        (d / s).write_text("#!/bin/sh\nexit 0\n")
        (d / s).chmod(0o755)
    return str(d)


def _execute(script: str, cwd, stubs: str) -> None:
    (cwd / "run_train.sh").write_text("#!/bin/sh\nexit 0\n")  # torchtitan's, which the titan script calls
    (cwd / "run_train.sh").chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(cwd)}
    p = subprocess.run(["bash", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def _no_canary(root) -> None:
    found = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f in ("P", "Q")]
    assert not found, f"a config value ran as code: {found}"


def _check_artifacts(framework, paths, cwd, stubs, benign_calls):
    for p in paths:
        if p.endswith(".sh"):
            r = subprocess.run(["bash", "-n", p], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            _execute(p, cwd, stubs)
        elif p.endswith(".py"):
            assert _calls(p) == benign_calls[os.path.basename(p)], f"{p}: its calls changed"
    _no_canary(cwd)


@pytest.fixture(scope="module")
def benign(tmp_path_factory):
    """Each framework's artifacts for a benign job: the calls its Python files make."""
    out = {}
    for fw in FRAMEWORKS:
        d = tmp_path_factory.mktemp(f"benign_{fw}")
        out[fw] = {os.path.basename(p): _calls(p) for p in _dry(fw, _cfg(fw), str(d / "job")) if p.endswith(".py")}
    return out


@pytest.mark.parametrize("case", sorted(HOSTILE_NAMES))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hostile_model_name_stays_data(framework, case, tmp_path, benign):
    name = HOSTILE_NAMES[case]
    paths = _dry(framework, _cfg(framework, name), str(tmp_path / "job"))
    _check_artifacts(framework, paths, tmp_path, _stub_path(tmp_path), benign[framework])
    if framework == "titan":  # the name is in the module as a literal, exactly
        tree = ast.parse(open(next(p for p in paths if p.endswith(".py"))).read())
        job = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "LEDGER_JOB")
        assert ast.literal_eval(job.value)["model"] == name
    if framework == "deepspeed":  # the model JSON reaches train_ds.py whole (stub python prints its argv)
        assert all(ln.startswith("#") or "touch" not in ln or "'" in ln
                   for ln in open(next(p for p in paths if p.endswith("run.sh"))).read().splitlines())


@pytest.mark.parametrize("case", sorted(HOSTILE_DIRS))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_hostile_job_dir_stays_data(framework, case, tmp_path, benign):
    job_dir = tmp_path / HOSTILE_DIRS[case]
    paths = _dry(framework, _cfg(framework), str(job_dir))
    _check_artifacts(framework, paths, tmp_path, _stub_path(tmp_path), benign[framework])


def test_stubbed_scripts_pass_the_model_json_whole(tmp_path):
    """DeepSpeed's run.sh hands train_ds.py the model as one JSON argument, a hostile name inside."""
    name = HOSTILE_NAMES["single_quote"]
    paths = _dry("deepspeed", _cfg("deepspeed", name), str(tmp_path / "job"))
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "deepspeed").write_text('#!/bin/bash\nfor a in "$@"; do printf "%s\\0" "$a"; done > argv\n')
    (stubs / "deepspeed").chmod(0o755)
    _execute(next(p for p in paths if p.endswith("run.sh")), tmp_path, str(stubs))
    argv = (tmp_path / "argv").read_text().split("\0")
    import json

    assert json.loads(argv[argv.index("--model") + 1])["name"] == name
    _no_canary(tmp_path)


# -- bad values -----------------------------------------------------------------------------------

BAD_VALUES = [
    ("model.hidden=-8", "model.hidden=-8 must be >= 1"),
    ("model.layers=0", "model.layers=0 must be >= 1"),
    ("model.vocab=0", "model.vocab=0 must be >= 1"),
    ("model.seq_len=0", "model.seq_len=0 must be >= 1"),
    ("model.ffn_hidden=0", "model.ffn_hidden=0 must be >= 1"),
    ("model.kv_heads=-2", "model.kv_heads=-2 must be >= 1"),
    ("model.heads=0", "model.heads=0 must be >= 1"),
    ("model.norm=batchnorm", "model.norm='batchnorm' must be one of rmsnorm, layernorm"),
    ("train.steps=0", "train.steps=0 must be >= 1"),
    ("cluster.ranks=0", "cluster.ranks=0 must be >= 1"),
    ("cluster.nodes=0", "cluster.nodes=0 must be >= 1"),
    ("ledger.mode=bogus", "ledger.mode='bogus' must be one of faithful, textbook"),
    ("wandb.mode=bogus", "wandb.mode='bogus' must be one of offline, online, disabled"),
    ("framework.zero_stage=4", "framework.zero_stage=4 must be one of 0, 1, 2, 3"),
    ("campaign.rerun=some", "campaign.rerun='some' must be one of all, failed, none"),
    ("mode=plot", "mode='plot' must be one of predict, run, dry, plan"),
    # the sizes past which a prediction would grow without bound (ledger/limits.py)
    ("model.layers=1025", "model.layers=1,025 is past train-ledger's bound of 1,024"),
    ("model.vocab=4294967296", "model.vocab=4,294,967,296 is past train-ledger's bound of 16,777,216"),
    ("model.hidden=1000000000", "model.hidden=1,000,000,000 is past train-ledger's bound of 262,144"),
    ("model.seq_len=100000000", "model.seq_len=100,000,000 is past train-ledger's bound of 4,194,304"),
    ("cluster.nodes=1000000", "cluster.ranks x cluster.nodes=2,000,000 is past train-ledger's bound of 1,048,576 GPUs"),
    ("layout.global_batch_size=10000000", "micro-batches per step: layout.global_batch_size/(micro_batch_size*dp)"
                                          "=10000000/(1*2)=5,000,000 is past train-ledger's bound of 8,192"),
]


@pytest.mark.parametrize("override,message", BAD_VALUES)
@pytest.mark.parametrize("mode", ["predict", "dry", "run"])
def test_bad_values_are_invalid_naming_the_field(override, message, mode):
    from launchers.job import check

    ovs = ["framework=deepspeed", f"mode={mode}", override] if not override.startswith("mode=") else \
        ["framework=deepspeed", override]
    with pytest.raises(ConfigError) as e:
        check(_compose(*ovs))
    assert message in str(e.value)


def test_a_layout_or_plan_past_its_bound_is_refused_with_the_numbers():
    from conf.validate import validate_config
    from launchers.job import check

    with pytest.raises(ConfigError, match=r"the layout's world tp\*pp\*dp\*cp=1\*1\*2000000\*1=2,000,000 is past "
                                          "train-ledger's bound of 1,048,576 GPUs"):
        check(_compose("framework=titan", "mode=predict", "layout.dp=2000000"))
    with pytest.raises(ConfigError, match="plan.gpus=200,000 is past train-ledger's bound of 131,072"):
        validate_config(_compose("mode=plan", "plan.gpus=200000", "plan.global_batch_tokens=4096"))


def test_zero_stage_0_is_refused_with_the_ledger_that_predicts_it():
    from launchers.job import check

    with pytest.raises(ConfigError, match="stage 0.*only with ledger.mode=textbook"):
        check(_compose("framework=deepspeed", "framework.zero_stage=0", "mode=predict"))
    check(_compose("framework=deepspeed", "framework.zero_stage=0", "mode=predict", "ledger.mode=textbook"))


def test_launch_exit_codes_for_bad_input(tmp_path):
    """The issue's commands: exit 2 naming the field, nothing written to run."""
    p = launch("mode=dry", "model.name=x'; touch P; echo '", "framework=deepspeed", f"hydra.run.dir={tmp_path / 'a'}")
    assert p.returncode == 2 and "model.name" in p.stderr
    assert not (tmp_path / "a" / "run.sh").exists() and not os.path.exists(os.path.join(REPO, "P"))
    p = launch("mode=dry", "model.name='x; touch P'", "framework=deepspeed", f"hydra.run.dir={tmp_path / 'b'}")
    assert p.returncode == 2 and "model.name='x; touch P' must match" in p.stderr
    assert not (tmp_path / "b" / "run.sh").exists()
    p = launch("mode=predict", "ledger.mode=bogus", f"hydra.run.dir={tmp_path / 'c'}")
    assert p.returncode == 2 and "job invalid: ledger.mode='bogus'" in p.stderr


# -- fuzz -----------------------------------------------------------------------------------------

FIELD = re.compile(r"\b[a-z_]+(\.[a-z_0-9]+)*=")


def _fuzz_one(framework: str, values: dict):
    from launchers.job import check

    cfg = _cfg(framework).copy()
    with open_dict(cfg):
        cfg.mode = "predict"
        for k, v in values.items():
            group, key = k.split(".")
            cfg[group][key] = v
    try:
        _, _, pl = check(cfg)
    except ConfigError as e:
        assert FIELD.search(str(e)), f"{values}: the error names no field: {e}"
        return "invalid"
    pred = pl.to_dict()
    for r in pred["rank_classes"]:
        for q in ("params_bytes", "grads_bytes", "optim_bytes", "other_bytes", "resident_bytes"):
            assert r[q] >= 0, (values, q, r[q])
        for c in r["comm"]:
            assert c["count"] >= 0 and c["buffer_bytes"] >= 0, (values, c)
    return "ok"


def test_fuzz_predict_is_ok_or_invalid_never_a_crash():
    """Random model, layout, framework and cluster values for all three frameworks in mode=predict:
    an ok prediction with non-negative bytes, or ConfigError naming a field (exit 2) -- any other
    exception (a traceback, exit 1) fails the test with its example."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    small = st.integers(min_value=-4, max_value=16)
    sizes = st.sampled_from([-8, 0, 1, 2, 3, 8, 64, 100, 256, 1001, 1024, 4096])
    knobs = {
        "megatron": {"framework.use_distributed_optimizer": st.booleans(),
                     "framework.overlap_grad_reduce": st.booleans(),
                     "framework.bucket_size": st.one_of(st.none(), st.integers(-2, 10 ** 6)),
                     "framework.precision": st.sampled_from(["bf16", "fp32", "fp8"])},
        "deepspeed": {"framework.zero_stage": st.integers(-1, 4),
                      "framework.reduce_bucket_size": st.integers(-2, 10 ** 6),
                      "framework.stage3_prefetch_bucket_size": st.integers(-2, 10 ** 6),
                      "framework.precision": st.sampled_from(["bf16", "fp32"])},
        "titan": {"framework.reshard_after_forward": st.sampled_from(["default", "always", "never", "sometimes"]),
                  "framework.mixed_precision_param": st.sampled_from(["bfloat16", "float32", "float16"])},
    }

    for framework in FRAMEWORKS:
        fields = {"model.layers": small, "model.hidden": sizes, "model.ffn_hidden": sizes,
                  "model.heads": small, "model.kv_heads": small, "model.vocab": sizes, "model.seq_len": sizes,
                  "model.norm": st.sampled_from(["rmsnorm", "layernorm", "batchnorm"]),
                  "model.tied_embeddings": st.booleans(),
                  "layout.tp": small, "layout.pp": small, "layout.dp": st.integers(-2, 16), "layout.cp": small,
                  "layout.vp": small, "layout.dp_replicate": small, "layout.micro_batch_size": small,
                  "layout.global_batch_size": st.integers(-2, 64), "layout.sequence_parallel": st.booleans(),
                  "cluster.ranks": small, "cluster.nodes": small, "train.steps": small,
                  "ledger.mode": st.sampled_from(["faithful", "textbook", "bogus"]), **knobs[framework]}
        seen = []

        @settings(max_examples=120, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(st.fixed_dictionaries({}, optional=fields))
        def fuzz(values):
            seen.append(_fuzz_one(framework, values))

        fuzz()
        assert "invalid" in seen, framework  # the strategies reach the rules


def test_an_unknown_key_exits_2_naming_it_with_or_without_plus(tmp_path):
    """`layout.tpp=2` (a typo) and `+layout.tpp=2` (the form Hydra suggests for it) both exit 2 naming
    the key and the group's fields, before Hydra composes or anything runs."""
    for arg in ("layout.tpp=2", "+layout.tpp=2", "++framework.zero_stag=3", "+foo.bar=1"):
        p = launch("mode=predict", arg, f"hydra.run.dir={tmp_path / 'x'}", timeout=120)
        key = arg.split("=")[0].lstrip("+~")
        assert p.returncode == 2 and f"invalid: {key}:" in p.stderr, (arg, p.returncode, p.stderr[-500:])
        assert not (tmp_path / "x").exists()
    p = launch("mode=predict", "+cluster.additional_parameters.exclusive=true", f"hydra.run.dir={tmp_path / 'y'}",
               timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]  # a dict-valued field takes any key


@pytest.mark.parametrize("field", ["partition", "account", "qos", "constraint"])
@pytest.mark.parametrize("value", ["gpu\ntouch canary\n#", "gpu'", 'gpu"', "gpu$(touch canary)", "gpu #x", "a b"])
def test_a_slurm_value_that_would_break_its_sbatch_line_is_refused_in_every_mode(field, value):
    """Every value an #SBATCH line (or submitit's) gets is checked with the config, whatever the mode."""
    from launchers.job import check

    cfg = _compose("mode=predict", "cluster=local_slurm")
    with open_dict(cfg):
        cfg.cluster[field] = value
    with pytest.raises(ConfigError, match=rf"cluster\.{field}="):
        check(cfg)
    cfg = _compose("mode=predict", "cluster=local_slurm")
    with open_dict(cfg):
        cfg.cluster.additional_parameters = {"comment": value}
    with pytest.raises(ConfigError, match=r"cluster\.additional_parameters\.comment="):
        check(cfg)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_dry_never_writes_through_a_symlink_at_an_artifacts_path(framework, tmp_path):
    """A symlink at run.sh / ds_config.json / the torchtitan module's path is replaced by the new file;
    its target is neither written nor made executable."""
    job = tmp_path / "job"
    names = {p.split(os.sep)[-1] for p in _dry(framework, _cfg(framework), str(tmp_path / "first"))}
    job.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    target.chmod(0o600)
    for name in names:
        (job / name).symlink_to(target)
    paths = _dry(framework, _cfg(framework), str(job))
    assert target.read_text() == "keep me\n" and oct(target.stat().st_mode & 0o777) == oct(0o600)
    assert all(not os.path.islink(p) for p in paths) and not list(job.glob("*.tmp.*"))


def test_a_rank_log_symlink_is_replaced_not_followed(tmp_path):
    from launchers import open_new

    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "rank0.log").symlink_to(target)
    with open_new(str(tmp_path / "rank0.log")) as f:
        f.write("log\n")
    assert target.read_text() == "keep me\n" and (tmp_path / "rank0.log").read_text() == "log\n"


def test_a_vocab_the_tokenizer_cannot_be_built_for_is_refused_or_capped(tmp_path):
    """torchtitan's tokenizer: below 258 tokens refused before anything is built (exit 2, naming the
    field); a vocab of 2^32 builds the same small tokenizer (the trainer is capped) instead of aborting."""
    from launchers import titan_assets
    from tests.conftest import launch

    p = launch("mode=dry", "framework=titan", "model.vocab=100", f"hydra.run.dir={tmp_path / 'small'}")
    assert p.returncode == 2 and "model.vocab=100 must be >= 258" in p.stdout + p.stderr
    small, _ = titan_assets.build(str(tmp_path / "a"), 4096)
    huge, _ = titan_assets.build(str(tmp_path / "b"), 4294967296)
    a, b = (json.load(open(os.path.join(d, "tokenizer.json")))["model"]["vocab"] for d in (small, huge))
    assert 258 < len(a) <= len(b) <= titan_assets.TRAINER_VOCAB_CAP


def test_a_fractional_rope_theta_is_refused_for_megatron_run_and_dry():
    """Megatron-LM's --rotary-base is an int: 0.5 would become 0; predict (no --rotary-base) goes on."""
    from launchers.job import check

    for mode in ("dry", "run"):
        with pytest.raises(ConfigError, match=r"model.rope_theta=0.5 must be an integer"):
            check(_compose(f"mode={mode}", "framework=megatron", "model.rope_theta=0.5"))
    check(_compose("mode=predict", "framework=megatron", "model.rope_theta=0.5"))
    check(_compose("mode=dry", "framework=megatron", "model.rope_theta=10000"))


@pytest.mark.parametrize("override,message", [
    ("model.layers=2.5", "model.layers=2.5 must be an integer"),
    ("layout.tp=x", "layout.tp='x' must be an integer"),
    ("model.layers=2,3.5", "model.layers=3.5 must be an integer"),
    ("model.rope_theta=abc", "model.rope_theta='abc' must be a number"),
    ("framework.overlap_grad_reduce=1", "framework.overlap_grad_reduce=1 must be true or false"),
])
def test_a_value_of_the_wrong_type_exits_2_naming_the_field(override, message, tmp_path):
    p = launch("mode=predict", "framework=megatron", override, f"hydra.run.dir={tmp_path}")
    assert p.returncode == 2 and f"invalid: {message}" in p.stderr, (p.returncode, p.stderr[-500:])


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_writers_leftover_temporaries_are_removed_at_the_next_write(tmp_path):
    """A `path.tmp.PID` a killed writer left (a big prediction.json's) is removed when the file is next
    written; a live writer's is not."""
    import records
    from launchers import write_file

    for name, write in (("prediction.json", lambda p: records.write_json(p, {"a": 1})),
                        ("run.sh", lambda p: write_file(p, "echo\n", 0o755))):
        path = str(tmp_path / name)
        dead, live = f"{path}.tmp.{_dead_pid()}", f"{path}.tmp.{os.getppid()}"
        for t in (dead, live):
            open(t, "w").write("half")
        write(path)
        assert not os.path.exists(dead) and os.path.exists(live) and os.path.exists(path)


def test_a_killed_launchers_fork_server_folder_is_removed_at_the_next_start(tmp_path):
    """The private fork servers' folders in TMPDIR whose launcher is gone are removed; a live one's and
    a folder with no owner file are kept."""
    from launchers import forkserver

    made = {}
    for name, pid in (("dead", _dead_pid()), ("live", os.getpid()), ("unowned", None)):
        d = tmp_path / f"{forkserver.PRIVATE_PREFIX}titan-{name}"
        d.mkdir()
        if pid is not None:
            (d / forkserver.OWNER).write_text(str(pid))
        made[name] = d
    assert forkserver.remove_orphaned_dirs(str(tmp_path)) == [str(made["dead"])]
    assert not made["dead"].exists() and made["live"].exists() and made["unowned"].exists()


def _listening(port: int) -> list[str]:
    """The local addresses listening on port (/proc/net/tcp and tcp6, state 0A)."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_the_local_rendezvous_store_listens_on_loopback_alone():
    """A local job's store (the launcher's, every rank a client) listens on 127.0.0.1, not on the
    machine's other interfaces."""
    from launchers.local import local_store

    with local_store(10) as port:
        assert _listening(port) == ["0100007F"]  # 127.0.0.1, little-endian hex
    assert _listening(port) == []
