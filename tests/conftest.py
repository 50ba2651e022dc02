import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker is one of several processes sharing the cores: one torch thread each (and
# in the processes its tests start), as torchrun gives each rank; threads that wait on each other across
# oversubscribed cores only add time. A single-process run keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_parallel():
    """A single-process gloo group with megatron-core's parallel state (TP=1, PP=1)."""
    from pretrain.parallel import ensure_model_parallel

    ensure_model_parallel(1, 1)
    yield


# The one tiny training run several modules read (tests/helpers.py TINY_RECIPE with these train keys):
# checkpoints at steps 2 and 4, EMA on. Tests must not change it: copy it first (shutil.copytree).
TINY_RUN_TRAIN = {"max_steps": 4, "save_every": 2, "eval_every": 0, "log_every": 2, "ema": 0.5, "sample_at_end": False,
                  "keep_last": 3}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(recipe path, run directory) of the shared tiny SW-SetDLM run, trained once per session."""
    from helpers import write_recipe
    from pretrain.config import load_config
    from pretrain.parallel import ensure_model_parallel
    from pretrain.trainer import Trainer

    ensure_model_parallel(1, 1)
    tmp = tmp_path_factory.mktemp("tiny_run")
    recipe = write_recipe(tmp / "r.yaml", train=TINY_RUN_TRAIN)
    Trainer(load_config(recipe, [f"run.out_dir={tmp / 'runs'}"])).train()
    return recipe, tmp / "runs" / "tiny"


@pytest.fixture(scope="session")
def serve_run(tmp_path_factory, model_parallel):
    """The tiny run the serving tests decode from (tests/serve_helpers.py:train_tiny), trained once."""
    from serve_helpers import train_tiny

    return train_tiny(tmp_path_factory.mktemp("serve_run"))


@pytest.fixture(scope="session")
def served(serve_run):
    """serve_run loaded as `setdlm serve` loads it (read-only: tests start their own servers on it)."""
    from serve.loading import load_served

    return load_served(serve_run, device="cpu")


@pytest.fixture(scope="module")
def server(served):
    """A loopback server (4 slots) on `served` for a test module."""
    from serve_helpers import ThreadServer

    srv = ThreadServer(served, max_batch=4)
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def random_gpt2_run(tmp_path_factory):
    """A tiny SW-SetDLM run directory with random weights and the GPT-2 tokenizer (no chat template, no
    ChatML tokens): for what a command reports or refuses, not for what a model learned."""
    import torch

    from data_pipeline.tokenizers import load_tokenizer
    from helpers import write_recipe
    from model.transformer import Transformer
    from pretrain.config import load_config
    from pretrain.convert.from_hf import write_run

    tmp = tmp_path_factory.mktemp("gpt2run")
    tok = load_tokenizer("gpt2")
    cfg = load_config(write_recipe(tmp / "r.yaml"), [f"run.out_dir={tmp}", "model.hidden=16", "model.ffn_hidden=32",
                                                     "model.n_heads=1"])
    cfg.resolve_vocab(tok)
    torch.manual_seed(0)
    write_run(tmp / "run", cfg, Transformer(cfg.model).state_dict(), tok, info={}, log=lambda s: None)
    return tmp / "run"


@pytest.fixture(scope="session")
def parity_runs(tmp_path_factory):
    """Every multi-process parity run (tests/test_parallel_parity.py RUNS: the plain layouts, and the
    recompute, compile, sequence-parallel, LoRA and overlap variants, each counting its collectives),
    launched once for the four modules that compare them; the folder holding their results."""
    from test_parallel_parity import run_all

    out = tmp_path_factory.mktemp("parity")
    run_all(out)
    return out


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a test module (tiny matmuls: threads only add contention on shared CPUs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real one-node Slurm cluster for a test module (skips without root or the Debian packages)."""
    from tests.cluster.slurm import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()  # a failure here is a real failure: root and the packages are present
    yield cluster
    cluster.stop()


@pytest.fixture
def mounts(tmp_path):
    """tmpfs and read-only bind mounts under tmp_path (tests/mounts.py), undone afterwards even when
    the test fails; skips without root or mount permission."""
    from mounts import Mounts

    reason = Mounts.unavailable(tmp_path)
    if reason:
        pytest.skip(reason)
    m = Mounts(tmp_path / "mnt")
    yield m
    m.close()


# -- running on two workers (pytest-xdist: `-n 2 --dist loadgroup`, the README's command) --------------
# Tests are sent to a worker a module at a time, so a module's own fixtures are built once. Modules that
# read one session-scoped run, or start the real Slurm cluster (fixed ports), form one group and share
# a worker: SHARED_GROUPS names them, and the collection refuses a module that uses one of those
# fixtures without being in its group. (xdist's own `loadgroup` reads `xdist_group` marks by rewriting
# node ids, which pytest 9 no longer allows; `pytest_xdist_make_scheduler` below takes its place.)
SHARED_GROUPS = {
    "parity_runs": ("test_parallel_parity", "test_recompute_parallel", "test_lora_parallel", "test_comm_plan"),
    "tiny_run": ("test_checkpoint_safety", "test_eval_overlong", "test_init_from_checkpoint", "test_context_parallel_runs"),
    "served": ("test_serve_api", "test_chat_template", "test_serve_clients", "test_serve_hostile", "test_serve_load",
               "test_trace_page"),
    "random_gpt2_run": ("test_eval_reports", "test_option_refusals"),
    "slurm": ("test_slurm_train", "test_rank_failures", "test_eval_slurm"),
}
FIXTURE_GROUP = {"parity_runs": "parity_runs", "tiny_run": "tiny_run", "serve_run": "served", "served": "served",
                 "server": "served", "random_gpt2_run": "random_gpt2_run", "slurm": "slurm"}
GROUP_OF = {module: group for group, modules in SHARED_GROUPS.items() for module in modules}
# Scopes (a group or a module) sent to the workers first, longest first (test time on two workers,
# docs/testing.md): xdist would order scopes by their number of tests, which leaves a long module with
# few tests (a study, a real Slurm job) for the end while the other worker idles. The rest follow in
# collection order and even out the two workers. A stale entry only costs balance, never a result.
LONGEST_FIRST = ("slurm", "parity_runs", "served", "tiny_run", "test_lora", "test_gpu_report", "test_layout_invariance",
                 "test_stock_export", "test_family_contract", "test_finetune_e2e", "test_zero3_init",
                 "test_checkpoint_parallel", "test_train_mixture", "test_study_families", "test_gsm8k_protocol",
                 "test_keep_best", "test_validation_rows", "test_convert_tp", "test_run_signals")
SCOPE_RANK = {scope: i for i, scope in enumerate(LONGEST_FIRST)}


def scope_of(module: str) -> str:
    """The unit a worker takes at once: the module's group, or the module itself."""
    return GROUP_OF.get(module, module)


def pytest_collection_modifyitems(config, items):
    missing = sorted({f"{item.module.__name__} uses {name} but is not in SHARED_GROUPS[{FIXTURE_GROUP[name]!r}]"
                      for item in items for name in getattr(item, "fixturenames", ())
                      if name in FIXTURE_GROUP and GROUP_OF.get(item.module.__name__) != FIXTURE_GROUP[name]})
    if missing:
        raise pytest.UsageError("tests/conftest.py: " + "; ".join(missing))
    # longest scopes first (a stable sort: a scope's tests keep their order)
    items.sort(key=lambda item: SCOPE_RANK.get(scope_of(getattr(item.module, "__name__", "")), len(LONGEST_FIRST)))


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (the GPU image) the hook is never called
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the collection's order: LONGEST_FIRST, then the rest

    class ModuleGroups(LoadScopeScheduling):
        """xdist's scope scheduling, a scope being a module or the group of SHARED_GROUPS it is in."""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            module = os.path.splitext(os.path.basename(path))[0]
            return GROUP_OF.get(module, path)

    return ModuleGroups(config, log)
