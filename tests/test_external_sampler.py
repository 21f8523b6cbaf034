"""An external sampler's round trip through a fake vLLM-style server that is jaxtune inside
(tests/fake_sampler_server.py): the pushed adapter samples what jaxtune's own `generate` samples with the same LoRA
parameters, the log-probs it reports are the learner's own (as GRPO scores them from `rollout_batch`), the previous
adapter is unloaded, and every failure is one line naming the URL."""

import socket
import threading
import time

import jax
import numpy as np
import pytest
from fake_sampler_server import FakeSampler

from jaxtune.config import ForwardOptions, SamplingConfig, tiny_config
from jaxtune.errors import ConfigError, JaxtuneError
from jaxtune.generation import generate
from jaxtune.methods import method_config
from jaxtune.methods.transform import apply_method
from jaxtune.models.params import init_params
from jaxtune.objectives.grpo import _token_logps, rollout_batch
from jaxtune.objectives.rollout_config import GRPOConfig
from jaxtune.rollouts import ExternalSampler, ExternalSamplerConfig, sample_group_external

CFG = tiny_config(vocab_size=259, eos_token_id=(2,), max_position_embeddings=64, initializer_range=0.3)
METHOD = method_config("lora", rank=4, target_modules=("q_proj", "v_proj"))
PROMPTS = [[1, 40, 41, 42], [1, 50, 51], [1, 60, 61, 62, 63]]
EOS = (2, 7)


def lora_params(seed: int) -> dict:
    """The tiny base with LoRA leaves whose B is not zero (so the adapter changes what is sampled)."""
    params = apply_method(init_params(CFG, jax.random.key(0)), CFG, METHOD, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(100 + seed), 64))
    layers = {name: {**m, "lora_b": 0.5 * jax.random.normal(next(keys), m["lora_b"].shape)}
              if isinstance(m, dict) and "lora_b" in m else m for name, m in params["layers"].items()}
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def server():
    with FakeSampler(CFG, init_params(CFG, jax.random.key(0))) as fake:
        yield fake


@pytest.fixture(autouse=True)
def fresh(server):
    """Each test starts from the base model with no adapter loaded and no fault."""
    server.fault, server.base = None, init_params(CFG, jax.random.key(0))
    server.adapters.clear()


@pytest.fixture
def sampler(server, tmp_path):
    return ExternalSampler(server.url, model=server.model, adapter_dir=tmp_path / "pushed", timeout_s=30)


def test_pushed_adapter_samples_what_jaxtune_generates(server, sampler):
    """(a) Greedy completions through the server equal jaxtune's own `generate` with the same LoRA parameters, a
    stopped completion ending with its stop token; the base model samples otherwise. (d) Each push loads a new name
    and unloads the one before (and its directory)."""
    sampler.wait_ready(timeout_s=10)
    params = lora_params(1)
    assert sampler.push_adapter(params, METHOD, CFG, step=0) == "jaxtune-step-0"
    got, logps = sampler.sample(PROMPTS, group_size=2, max_new_tokens=8, temperature=0.0, eos_ids=EOS,
                                vocab_size=CFG.vocab_size)
    repeated = [p for p in PROMPTS for _ in range(2)]
    want = generate(params, CFG, repeated, SamplingConfig(max_new_tokens=8, temperature=0.0), eos_ids=EOS,
                    method=METHOD, include_stop=True)
    assert got == want and [len(v) for v in logps] == [len(c) for c in got]
    base = generate(init_params(CFG, jax.random.key(0)), CFG, repeated, SamplingConfig(max_new_tokens=8), eos_ids=EOS,
                    include_stop=True)
    assert base != want  # the adapter matters

    second = lora_params(2)
    sampler.push_adapter(second, METHOD, CFG, step=1)
    assert [p for p, _ in server.log if "lora_adapter" in p][-2:] == ["/v1/load_lora_adapter",
                                                                       "/v1/unload_lora_adapter"]
    assert server.log[-1][1] == {"lora_name": "jaxtune-step-0"}
    assert set(server.adapters) == {"jaxtune-step-1"}
    assert not (sampler.adapter_dir / "step-0").exists() and (sampler.adapter_dir / "step-1").is_dir()
    sampler.push_adapter(second, METHOD, CFG, step=1)  # the same step again: replaced in place
    assert server.log[-1][1]["load_inplace"] is True and set(server.adapters) == {"jaxtune-step-1"}
    got, _ = sampler.sample(PROMPTS, 1, 8, temperature=0.0, eos_ids=EOS)
    assert got == generate(second, CFG, PROMPTS, SamplingConfig(max_new_tokens=8), eos_ids=EOS, method=METHOD,
                           include_stop=True)


def test_sampler_logps_are_the_learners_through_rollout_batch(server, sampler):
    """(b) sample_group_external at temperature 0.7 with top-k: rows in GRPO's order (G consecutive per prompt), and
    the sampler's log-probs, placed by `rollout_batch(sampler_logps=)`, equal the learner's per-token log-probs of
    the same tokens as GRPO scores them (`_token_logps`, logits / temperature) within 1e-5."""
    params = lora_params(3)
    rollout = GRPOConfig(group_size=2, max_new_tokens=8, temperature=0.7, top_k=50)
    rows, completions, logps = sample_group_external(sampler, params, CFG, METHOD, PROMPTS, rollout, seed=5,
                                                     eos_ids=EOS)
    assert rows == [p for p in PROMPTS for _ in range(2)]
    assert len({tuple(c) for c in completions}) > 3  # sampled, not greedy
    assert all(len(c) == 8 or c[-1] in EOS for c in completions)
    batch = rollout_batch(rows, completions, [0.0] * len(rows), np.zeros(len(rows)), 24, sampler_logps=logps)
    score = jax.jit(lambda p, b: _token_logps(p, CFG, b, METHOD, ForwardOptions(), rollout.temperature))
    learner = np.asarray(score(params, batch))
    mask = batch["loss_mask"] > 0
    assert mask.sum() == sum(len(c) for c in completions)
    np.testing.assert_allclose(batch["sampler_logps"][mask], learner[mask], atol=1e-5)
    # the same batch number pushes nothing again; the next push_every does
    loads = sum(p.endswith("load_lora_adapter") for p, _ in server.log)
    sample_group_external(sampler, params, CFG, METHOD, PROMPTS, rollout, 6, EOS, step=1, push_every=2)
    assert sum(p.endswith("load_lora_adapter") for p, _ in server.log) == loads
    sample_group_external(sampler, params, CFG, METHOD, PROMPTS, rollout, 7, EOS, step=2, push_every=2)
    assert sampler.adapter == "jaxtune-step-2"


def test_sglang_adapter_and_its_generate_route(server, tmp_path):
    """SGLang's routes: the adapter loaded through /load_lora_adapter (and the previous unloaded), the rows sampled
    through /generate (a prompt repeated G times, `lora_path` naming the adapter) as jaxtune's `generate` samples."""
    sampler = ExternalSampler(server.url, model=server.model, adapter_dir=tmp_path / "sgl", server="sglang")
    params = lora_params(5)
    sampler.push_adapter(lora_params(6), METHOD, CFG, step=0)
    sampler.push_adapter(params, METHOD, CFG, step=1)
    assert [p for p, _ in server.log[-3:]] == ["/load_lora_adapter", "/load_lora_adapter", "/unload_lora_adapter"]
    got, logps = sampler.sample(PROMPTS, 2, 8, temperature=0.0, eos_ids=EOS, vocab_size=CFG.vocab_size)
    assert server.log[-1][0] == "/generate" and server.log[-1][1]["lora_path"] == ["jaxtune-step-1"] * 6
    repeated = [p for p in PROMPTS for _ in range(2)]
    assert got == generate(params, CFG, repeated, SamplingConfig(max_new_tokens=8), eos_ids=EOS, method=METHOD,
                           include_stop=True)
    assert [len(v) for v in logps] == [len(c) for c in got]


def test_merged_weights_through_update_weights_from_disk(server, tmp_path):
    """SGLang's path: the merged model written to disk and read by the server samples what the adapter does."""
    sampler = ExternalSampler(server.url, model=server.model, adapter_dir=tmp_path / "merged", server="sglang")
    params = lora_params(4)
    where = sampler.push_merged(params, METHOD, CFG, step=3, dtype="float32")
    assert server.log[-1] == ("/update_weights_from_disk", {"model_path": where})
    got, _ = sampler.sample(PROMPTS, 1, 8, temperature=0.0, eos_ids=EOS)
    assert server.log[-1][0] == "/generate" and "lora_path" not in server.log[-1][1]
    assert got == generate(params, CFG, PROMPTS, SamplingConfig(max_new_tokens=8), eos_ids=EOS, method=METHOD,
                           include_stop=True)
    vllm = ExternalSampler(server.url, model=server.model, adapter_dir=tmp_path / "v")
    with pytest.raises(JaxtuneError, match="vLLM has no from-disk weight update"):
        vllm.push_merged(params, METHOD, CFG, step=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("fault, message", [
    ("http_error", r"^POST http://127\.0\.0\.1:\d+/v1/completions: HTTP 500: CUDA out of memory\. Tried to allocate"),
    ("malformed", r"/v1/completions: the reply is not JSON: '<html>502 Bad Gateway</html>'$"),
    ("no_logprobs", r"/v1/completions: choice 0 has no logprobs\.token_logprobs"),
    ("bad_token", r"/v1/completions: choice 0: token id 266 is outside the vocabulary \[0, 259\)$"),
    ("slow", r"/v1/completions: no reply within timeout_s = 0\.5$"),
])
def test_each_failure_is_one_line_naming_the_url(server, sampler, fault, message):
    """(c) An HTTP error (its message, one line), a reply that is not JSON, no log-probs, an id outside the
    vocabulary, a timeout."""
    server.fault, server.slow_s = fault, 1.5
    sampler.timeout_s = 0.5 if fault == "slow" else 30
    try:
        with pytest.raises(JaxtuneError, match=message) as e:
            sampler.sample(PROMPTS, 2, 8, temperature=0.0, eos_ids=EOS, vocab_size=CFG.vocab_size)
    finally:
        server.fault = None
    assert "\n" not in str(e.value) and server.url in str(e.value)


def test_unknown_adapter_and_server_down(server, sampler, tmp_path):
    sampler.adapter = "jaxtune-step-99"
    with pytest.raises(JaxtuneError, match=r"/v1/completions: HTTP 404: The model `jaxtune-step-99` does not exist"):
        sampler.sample(PROMPTS[:1], 2, 4)
    down = ExternalSampler(f"http://127.0.0.1:{free_port()}", model="m", adapter_dir=tmp_path, connect_retries=2,
                           backoff_s=0.01)
    with pytest.raises(JaxtuneError, match=r"^POST http://127\.0\.0\.1:\d+/v1/completions: cannot connect \(after 3 "
                                           r"attempts\): .*is the sampling server running there\?$"):
        down.sample(PROMPTS[:1], 2, 4)
    with pytest.raises(JaxtuneError, match=r"not ready within 0\.2 s: .*cannot connect"):
        down.wait_ready(timeout_s=0.2, poll_s=0.05)


def test_a_server_that_starts_late_is_waited_for(tmp_path):
    """Connection refused while the server starts: retried with backoff until it answers."""
    port = free_port()
    sampler = ExternalSampler(f"http://127.0.0.1:{port}", model="m", adapter_dir=tmp_path, connect_retries=6,
                              backoff_s=0.05)
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            data = b'{"data": [{"id": "m"}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_):
            pass

    def start_late():
        time.sleep(0.3)
        with HTTPServer(("127.0.0.1", port), Models) as httpd:
            httpd.handle_request()

    thread = threading.Thread(target=start_late)
    thread.start()
    assert sampler.request("GET", "/v1/models") == {"data": [{"id": "m"}]}
    thread.join()


def test_config_is_checked():
    assert ExternalSamplerConfig().url == ""  # off by default
    config = ExternalSamplerConfig(url="http://h:8000", model="m", adapter_dir="/shared/a", push_every=2)
    assert ExternalSampler.from_config(config).url == "http://h:8000"
    for bad, field in [(dict(url="h:8000", model="m", adapter_dir="a"), "sampler_url"),
                       (dict(url="http://h", adapter_dir="a"), "sampler_model"),
                       (dict(url="http://h", model="m"), "sampler_adapter_dir"),
                       (dict(weights="merged"), "sampler_weights"),
                       (dict(server="tgi"), "sampler_server"),
                       (dict(push_every=0), "sampler_push_every")]:
        with pytest.raises(ConfigError, match=f"^{field} = "):
            ExternalSamplerConfig(**bad)


@pytest.mark.full
def test_a_grpo_run_samples_from_the_server_as_from_its_own_decode(tmp_path):
    """`[grpo] sampler_url` on a server serving the run's own base model: every rollout batch pushes the adapter
    and samples there, the sampler's log-probs weigh the loss (importance sampling on: weights 1 within float
    noise), and the run's metrics equal a run that decodes itself, within 1e-5."""
    import json

    from test_rollouts_across_devices import assert_same_run, rollout_config  # noqa: I001

    from jaxtune.run_config import load_run_config
    from jaxtune.spine.model import load_model
    from jaxtune.train.loop import fine_tune

    config = rollout_config(tmp_path, "grpo")
    extra = ["grpo.sampler_importance_sampling_correction=true"]
    own = fine_tune(load_run_config(config, [f"train.output_dir={tmp_path / 'own'}", *extra]), log=lambda *_: None)
    cfg, params = load_model(tmp_path / "model")
    with FakeSampler(cfg, params, model="served-base") as server:
        external = fine_tune(load_run_config(config, [
            f"train.output_dir={tmp_path / 'external'}", *extra, f'grpo.sampler_url="{server.url}"',
            'grpo.sampler_model="served-base"', f'grpo.sampler_adapter_dir="{tmp_path / "pushed"}"']),
            log=lambda *_: None)
        assert list(server.adapters) == ["jaxtune-step-2"]  # three batches pushed, the two before unloaded
    lines = lambda run: [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    one, other = lines(own), lines(external)
    for a, b in zip(other, one):  # the weights 1 within the two forwards' float32 rounding: ~1e-6 of a loss ~0
        assert abs(a.get("loss", 0) - b.get("loss", 0)) <= 1e-5, (a, b)
    assert_same_run([{**a, **{k: b[k] for k in ("loss",) if k in b}} for a, b in zip(other, one)], one)
