"""Make the repository root importable (model.py, stream.py, optim.py live there) and share helpers: random
batches, tiny tokenizers, a fast runner of train.py (TrainCLI) and the "nothing lost" check (assert_refused)."""
import atexit
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import model  # noqa: E402

# grouped-query attention, Qwen2 qkv bias, Qwen3 q/k norm with an explicit head_dim, tied embeddings
SPECIAL = model.GPTConfig(vocab_size=97, n_layer=3, n_head=4, n_kv_head=2, d_model=64, d_ff=96, head_dim=32,
                          qkv_bias=True, qk_norm=True, tie_embeddings=True, max_seq_len=64)


def engine(cfg, weights, offload_activations=False, skip_nonfinite=False, tile_tokens=0, gpu_updated_units=0,
           checked=True, **kw):
    """A trainer on `weights`, handed the objects that plain settings make (engine.parts: activations.HostRing,
    guard.Guard, tiling.Tiled, gpu_update.GpuUpdates): checks.CheckedTrainer, every argument checked, or
    stream.Trainer itself (checked=False)."""
    import stream
    from megatrain_min import checks
    from megatrain_min.engine import parts
    cls = checks.CheckedTrainer if checked else stream.Trainer
    return cls(cfg, weights, **{**parts(offload_activations, skip_nonfinite, tile_tokens, gpu_updated_units), **kw})


def random_batch(cfg, B, T, gen, ignore_frac=0.2):
    """tokens, targets (B, T); a fraction of the targets set to -100."""
    tok = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=gen)
    tgt[torch.rand(B, T, generator=gen) < ignore_frac] = model.IGNORE
    return tok, tgt


def losses_agree(a, b, cfg, gen, steps, B, T, rtol):
    """Step trainers a and b on the same random batches; every step's losses agree to rtol (relative)."""
    for s in range(steps):
        tok, tgt = random_batch(cfg, B, T, gen)
        la, lb = a.step(tok, tgt), b.step(tok, tgt)
        assert abs(la - lb) / abs(lb) <= rtol, f"step {s}: loss {la} vs {lb}"


def update_rel(w0, wa, wb):
    """||(wa - w0) - (wb - w0)|| / ||wb - w0|| over all tensors: how far two updates are apart."""
    num = sum(((wa[k] - wb[k]).double() ** 2).sum() for k in wb) ** 0.5
    den = sum(((wb[k] - w0[k]).double() ** 2).sum() for k in wb) ** 0.5
    return float(num / den)


SPLIT = {  # the split regexes of the published tokenizer.json files (Llama 3 groups up to 3 digits, Qwen2 none)
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def make_bpe_tokenizer(directory, texts, vocab_size, special_tokens, tokenizer_config, style="gpt2",
                       added_tokens=()):
    """A tiny BPE tokenizer trained here on `texts`, saved as directory/tokenizer.json with a
    tokenizer_config.json (nothing is downloaded). Returns the tokenizers.Tokenizer.
    style: the pipeline of a published family, so that transformers 5 (whose Qwen2Tokenizer and
    LlamaTokenizer rebuild it rather than read it from tokenizer.json) tokenizes like the file:
    "gpt2" byte-level; "llama3" and "qwen2" byte-level after the family's split regex (and NFC for Qwen2);
    "sentencepiece" (Llama 2, Mistral) spaces as U+2581, one before the text, unknown characters -> the
    first special token. added_tokens: added, not special (Qwen3's <think>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    if style == "sentencepiece":
        tok = Tokenizer(models.BPE(unk_token=special_tokens[0], fuse_unk=True, byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])            # as the published files
        alphabet = sorted(set("".join(texts)))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if style in SPLIT:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(SPLIT[style]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        if style == "qwen2":
            tok.normalizer = normalizers.NFC()
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                                       initial_alphabet=alphabet))
    tok.add_tokens(list(added_tokens))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return tok


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


# ----------------------------------------------------------------------------- train.py as a user runs it, fast
# Every `python train.py ...` pays ~3 CPU-seconds importing torch before it looks at a flag. TrainCLI pays it
# once: a helper process imports train.py's dependencies (and computes nothing, so forking it is safe: no
# OpenMP team exists yet), then forks one fresh child per run. The child runs train.py (or another script, or
# `python -m module`) as __main__ in its own process -- own pid, cwd, stdout/stderr files, exit code, signals,
# file locks -- and ends the way the interpreter ends a script: SystemExit's code, or the traceback of an
# uncaught exception and exit code 1.
ZYGOTE = r"""
import json, os, resource, runpy, signal, sys, traceback
sys.path.insert(0, sys.argv[1])
import numpy, torch, tqdm, model, optim, stream  # noqa: the imports train.py would pay for on every run
from megatrain_min import checkpoint, data, engine, hf, plan, reference  # noqa
import torch._dynamo, torch._subclasses.fake_tensor  # noqa: the planner's FakeTensorMode imports them (~1.7 s)
import jinja2, safetensors, tokenizers  # noqa: fine-tuning data and exports
for line in sys.stdin:
    req = json.loads(line)
    if "wait" in req:
        print(json.dumps({"rc": os.waitstatus_to_exitcode(os.waitpid(req["wait"], 0)[1])}), flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(req["cwd"])
            for fd, path in ((0, os.devnull), (1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC), fd)
            if req["fsize"] is not None:                  # `ulimit -f`: a write past it fails with EFBIG
                resource.setrlimit(resource.RLIMIT_FSIZE, (req["fsize"], req["fsize"]))
            if req["memory"] is not None:                 # `ulimit -v`: this many bytes more than it maps now
                status = open("/proc/self/status").read().splitlines()
                vm = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
                resource.setrlimit(resource.RLIMIT_AS, (vm + req["memory"], vm + req["memory"]))
            if req["modes"]:                              # root ignores file modes: drop CAP_DAC_OVERRIDE and
                import ctypes                             # CAP_DAC_READ_SEARCH (capability bits 1, 2) so they apply
                libc = ctypes.CDLL(None, use_errno=True)
                hdr, caps = (ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()  # v3 header, 2 x (eff, prm, inh)
                libc.capget(hdr, caps)
                caps[0] &= ~0b110
                if libc.capset(hdr, caps):
                    raise OSError(ctypes.get_errno(), "capset")
            signal.alarm(req["timeout"])                  # a hung run is killed
            os.environ.update(req["env"])
            if "PYTHONIOENCODING" in req["env"]:          # as the interpreter sets its streams up at start
                enc, _, errors = req["env"]["PYTHONIOENCODING"].partition(":")
                for s in (sys.stdout, sys.stderr):
                    s.reconfigure(encoding=enc or None, errors=errors or None)
            if req["module"]:                             # python -m module argv...
                sys.argv = [req["module"], *req["argv"]]
                sys.modules.pop(req["module"], None)      # run afresh as __main__, as python -m does
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [os.path.join(sys.argv[1], req["script"]), *req["argv"]]
                sys.path[0] = os.path.dirname(sys.argv[0])   # as `python script.py` puts the script's folder first
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else (print(e.code, file=sys.stderr), 1)[1]
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
"""


class TrainCLI:
    """cli(*args, cwd=...) -> subprocess.CompletedProcess of `python train.py *args`; cli.start(...) -> a Run
    with .pid, whose result cli.wait(run) gives (runs may overlap: the lock and signal tests).
    script: another script of the repository (a lesson, a bench), or module: `python -m module *args`;
    env: variables set in the child; fsize: RLIMIT_FSIZE in bytes; memory: RLIMIT_AS, in bytes beyond what the
    child maps at its start (a command that would allocate more fails there, not on the machine); modes: file
    modes apply even to root (the tests run as root in containers)."""

    def __init__(self, tmp):
        self.tmp, self.n = tmp, 0
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(ROOT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, *args, cwd=ROOT, fsize=None, modes=False, timeout=300, script="train.py", module=None, env=None,
              memory=None):
        self.n += 1
        out, err = self.tmp / f"{self.n}.out", self.tmp / f"{self.n}.err"
        argv = [str(a) for a in args]
        pid = self._ask(dict(argv=argv, cwd=str(cwd), stdout=str(out), stderr=str(err), fsize=fsize, modes=modes,
                             timeout=timeout, script=str(script), module=module, env=env or {},
                             memory=memory))["pid"]
        return SimpleNamespace(pid=pid, argv=[module or str(script), *argv], out=out, err=err)

    def wait(self, run):
        rc = self._ask({"wait": run.pid})["rc"]
        return subprocess.CompletedProcess(run.argv, rc, run.out.read_text(), run.err.read_text())

    def __call__(self, *args, **kw):
        return self.wait(self.start(*args, **kw))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


_RUNNER = []


def runner():
    """This test process's TrainCLI, started on first use and closed (its files removed) when the process exits."""
    if not _RUNNER:
        tmp = Path(tempfile.mkdtemp(prefix="traincli-"))
        _RUNNER.append(TrainCLI(tmp))
        atexit.register(lambda: (_RUNNER[0].close(), shutil.rmtree(tmp, ignore_errors=True)))
    return _RUNNER[0]


def train_py(*args, **kw):
    """`python train.py *args` (or script= / module=, see TrainCLI.start) in a fresh process: CompletedProcess."""
    return runner()(*args, **kw)


@pytest.fixture(scope="session")
def cli():
    return runner()


@pytest.fixture(scope="session")
def multi_gpu_smoke(tmp_path_factory):
    """bench/multi_gpu.py --smoke, run once: its directory. Its exact case's runs -- python train.py and torchrun
    with 2 gloo ranks, the same flags, checkpoints every 4 steps -- are read by tests/test_bench.py (the harness)
    and tests/test_sharded.py (train.py under torchrun); nothing writes into them."""
    out = tmp_path_factory.mktemp("multi_gpu")
    r = train_py("--smoke", "--out", out, script="bench/multi_gpu.py")
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def wait_for_training(out, timeout=120):
    """Block until the run writing to `out` has logged its first step."""
    deadline = time.time() + timeout
    while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
        assert time.time() < deadline, f"no step logged in {out} after {timeout} s"
        time.sleep(0.02)


# ----------------------------------------------------------------------------- "nothing lost"
def files_under(*roots):
    """{path: bytes} of every file under the given directories (or files): what 'nothing lost' compares."""
    found = {}
    for root in map(Path, roots):
        for p in [root] if root.is_file() else sorted(root.rglob("*")) if root.is_dir() else []:
            if p.is_file():
                found[p] = p.read_bytes()
    return found


def lost(before):
    """The files of `before` (files_under's result) that are gone or changed now; [] = nothing lost."""
    return [str(p) for p, b in before.items() if not p.is_file() or p.read_bytes() != b]


def assert_refused(r, before, code=2, words=()):
    """train.py refused or stopped as documented: exit `code`, one line on stderr holding `words`, no
    traceback, and every file that existed before the run is still there byte for byte."""
    err = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == code, f"exit {r.returncode}, expected {code}\n{r.stderr}"
    assert len(err) == 1 and all(w in err[0] for w in words), r.stderr
    assert not lost(before), lost(before)
