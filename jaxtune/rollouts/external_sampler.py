"""Rollouts from an external sampler: a vLLM (GPU), vLLM-TPU or SGLang server beside the trainer, spoken to over
HTTP with the standard library (`openai_protocol.py`: the wire format and the servers' sources it follows).

The policy goes out as a PEFT adapter written by jaxtune's exporter (`save_peft_adapter`, what `train/export.py`
writes), loaded under a new name per push before the previous one is unloaded; or, to SGLang, as a merged Hugging
Face directory. `sample` reads back G completions a prompt with their per-token log-probs in GRPO's row order, and
`sample_group_external` is `grpo.sample_group` with those beside (`rollout_batch`'s `sampler_logps`). Every failure
is one `JaxtuneError` line naming the URL; a refused connection (a server still starting) is retried with backoff.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxtune.config import MethodConfig, ModelConfig
from jaxtune.errors import ConfigError, JaxtuneError, check_choice, check_range
from jaxtune.methods.base import method_unit
from jaxtune.methods.peft import save_peft_adapter
from jaxtune.models.hf_weights import save_model
from jaxtune.rollouts import openai_protocol as wire


@dataclass(frozen=True)
class ExternalSamplerConfig:
    """Where GRPO's and RLOO's rollouts come from when not from jaxtune's own decoding (the `[grpo] sampler_*` keys).
    url: the server's base URL (e.g. "http://localhost:8000"; empty: jaxtune samples itself). model: the served base
    model's name (`--served-model-name`, default its path). adapter_dir: where jaxtune writes each push, a directory
    the server can read; server_adapter_dir: the same directory as the server sees it (a container's mount; empty:
    the same path). server: "vllm" (vLLM, vLLM-TPU) or "sglang": the paths of the LoRA routes. weights: "lora"
    (a PEFT adapter loaded at run time) or "merged" (a merged HF directory, SGLang's `update_weights_from_disk`).
    push_every: push the policy every this many rollout batches (1: each; the sampler lags by up to push_every - 1).
    timeout_s: of each request; connect_retries: attempts while the connection is refused (the server starting)."""

    url: str = ""
    model: str = ""
    adapter_dir: str = ""
    server_adapter_dir: str = ""
    server: str = "vllm"
    weights: str = "lora"
    push_every: int = 1
    timeout_s: float = 600.0
    connect_retries: int = 5

    def __post_init__(self):
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError("sampler_url", self.url, "must start with http:// or https://")
        if self.url and not self.model:
            raise ConfigError("sampler_model", self.model, "must name the served base model with sampler_url")
        if self.url and not self.adapter_dir:
            raise ConfigError("sampler_adapter_dir", self.adapter_dir, "must be set with sampler_url (a directory "
                              "the server can read)")
        check_choice("sampler_server", self.server, wire.SERVERS)
        check_choice("sampler_weights", self.weights, ("lora", "merged"))
        if self.weights == "merged" and self.server != "sglang":
            raise ConfigError("sampler_weights", self.weights, "merged weights need sampler_server = \"sglang\" "
                              "(vLLM has no from-disk weight update over HTTP)")
        check_range("sampler_push_every", self.push_every, 1)
        check_range("sampler_timeout_s", self.timeout_s, 0, low_open=True)
        check_range("sampler_connect_retries", self.connect_retries, 0)


class ExternalSampler:
    """A client of one OpenAI-compatible sampling server:

        sampler = ExternalSampler("http://gpu-host:8000", model="Qwen/Qwen3-0.6B", adapter_dir="/shared/lora")
        sampler.wait_ready()
        sampler.push_adapter(params, method, cfg, step=0)   # loaded as "jaxtune-step-0"
        completions, logps = sampler.sample(prompt_ids, group_size=8, max_new_tokens=256, temperature=1.0,
                                            eos_ids=[151645])
    """

    def __init__(self, url: str, *, model: str, adapter_dir: str | Path, timeout_s: float = 600.0,
                 server_adapter_dir: str | Path = "", server: str = "vllm", connect_retries: int = 5,
                 backoff_s: float = 0.5, name_prefix: str = "jaxtune"):
        self.url = url.rstrip("/")
        self.model, self.timeout_s, self.server = model, timeout_s, server
        self.adapter_dir = Path(adapter_dir)
        self.server_adapter_dir = str(server_adapter_dir) if server_adapter_dir else ""
        self.connect_retries, self.backoff_s, self.name_prefix = connect_retries, backoff_s, name_prefix
        self.adapter: str | None = None  # the adapter name requests sample from; None: the base (or merged) model
        self.pushed_step: int | None = None
        check_choice("server", server, wire.SERVERS)

    @classmethod
    def from_config(cls, config: ExternalSamplerConfig) -> ExternalSampler:
        return cls(config.url, model=config.model, adapter_dir=config.adapter_dir, timeout_s=config.timeout_s,
                   server_adapter_dir=config.server_adapter_dir, server=config.server,
                   connect_retries=config.connect_retries)

    # -- HTTP -------------------------------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict | None = None, *, expect_json: bool = True):
        """The decoded JSON reply (or the text, with expect_json False) of `method url+path` with a JSON body."""
        url = self.url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        for attempt in range(self.connect_retries + 1):
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as reply:
                    raw = reply.read()
                break
            except urllib.error.HTTPError as e:
                raise JaxtuneError(f"{method} {url}: HTTP {e.code}: {wire.error_message(e.read())}") from None
            except urllib.error.URLError as e:
                reason = e.reason
                if isinstance(reason, ConnectionRefusedError) and attempt < self.connect_retries:
                    time.sleep(self.backoff_s * 2 ** attempt)  # the server may still be starting
                    continue
                if isinstance(reason, (socket.timeout, TimeoutError)):
                    raise JaxtuneError(f"{method} {url}: no reply within timeout_s = {self.timeout_s:g}") from None
                tries = f" (after {attempt + 1} attempts)" if isinstance(reason, ConnectionRefusedError) else ""
                raise JaxtuneError(f"{method} {url}: cannot connect{tries}: {wire.one_line(str(reason))}; is the "
                                   "sampling server running there?") from None
            except (socket.timeout, TimeoutError):
                raise JaxtuneError(f"{method} {url}: no reply within timeout_s = {self.timeout_s:g}") from None
            except (ConnectionError, http.client.HTTPException) as e:
                raise JaxtuneError(f"{method} {url}: the connection failed: {type(e).__name__}: "
                                   f"{wire.one_line(str(e))}") from None
        text = raw.decode("utf-8", "replace")
        if not expect_json:
            return text
        try:
            return json.loads(text)
        except ValueError:
            raise JaxtuneError(f"{method} {url}: the reply is not JSON: {wire.one_line(text, 80)!r}") from None

    def wait_ready(self, timeout_s: float = 600.0, poll_s: float = 1.0) -> None:
        """Wait until `GET /health` answers 200 and `/v1/models` serves `model`; a JaxtuneError after timeout_s."""
        deadline, last = time.monotonic() + timeout_s, "no reply"
        while time.monotonic() < deadline:
            try:
                self.request("GET", wire.HEALTH, expect_json=False)
                served = [m.get("id") for m in self.request("GET", wire.MODELS).get("data", [])]
                if self.model in served:
                    return
                last = f"it serves {served}, not model {self.model!r}"
            except JaxtuneError as e:
                last = str(e)
            time.sleep(poll_s)
        raise JaxtuneError(f"{self.url}: not ready within {timeout_s:g} s: {last}")

    # -- weights ----------------------------------------------------------------------------------------------------

    def _server_path(self, local: Path) -> str:
        if not self.server_adapter_dir:
            return str(local.resolve())
        return str(Path(self.server_adapter_dir) / local.relative_to(self.adapter_dir))

    def push_adapter(self, params: dict, method: MethodConfig, cfg: ModelConfig, step: int,
                     initial: dict | None = None) -> str:
        """Write `method`'s leaves of `params` as a PEFT adapter (`save_peft_adapter`, as `train/export.py` writes
        a run's) to adapter_dir/step-<step>, load it as "<prefix>-step-<step>", then unload the adapter pushed
        before and delete its directory. Returns the new name, which `sample` uses from then on. initial: a PiSSA
        or OLoRA adapter's init leaves (`export_result`'s)."""
        name = f"{self.name_prefix}-step-{step}"
        local = self.adapter_dir / f"step-{step}"
        if local.exists():
            shutil.rmtree(local)
        save_peft_adapter(local, params, cfg, method, base_model=self.model, initial=initial)
        load, unload = wire.LORA_PATHS[self.server]
        self.request("POST", load, wire.lora_load_request(name, self._server_path(local), inplace=name == self.adapter),
                     expect_json=False)
        previous, previous_step = self.adapter, self.pushed_step
        self.adapter, self.pushed_step = name, step
        if previous is not None and previous != name:
            self.request("POST", unload, wire.lora_unload_request(previous), expect_json=False)
            shutil.rmtree(self.adapter_dir / f"step-{previous_step}", ignore_errors=True)
        return name

    def push_merged(self, params: dict, method: MethodConfig | None, cfg: ModelConfig, step: int,
                    dtype: str | None = "bfloat16") -> str:
        """Write `params` with the adapter merged in (or a full fine-tune's own) as a Hugging Face directory
        adapter_dir/merged-step-<step> and have SGLang read it in place (`/update_weights_from_disk`); the previous
        push's directory is deleted. Returns the directory as the server sees it."""
        if self.server != "sglang":
            raise JaxtuneError(f"{self.url}: merged weights are pushed to SGLang (update_weights_from_disk); vLLM "
                               "has no from-disk weight update over HTTP: push a LoRA adapter instead")
        tensor = None
        if method is not None and not method_unit(method).trains_base:
            merge = method_unit(method).merged_layer
            if merge is None:
                raise JaxtuneError(f"method {method.kind!r} does not merge into the weights: push_adapter instead")
            tensor = merge(params, method, cfg)
        local = self.adapter_dir / f"merged-step-{step}"
        if local.exists():
            shutil.rmtree(local)
        save_model(local, cfg, params, dtype=dtype, tensor=tensor)
        where = self._server_path(local)
        reply = self.request("POST", wire.UPDATE_FROM_DISK, wire.update_from_disk_request(where))
        if not (isinstance(reply, dict) and reply.get("success")):
            message = reply.get("message") if isinstance(reply, dict) else reply
            raise JaxtuneError(f"POST {self.url}{wire.UPDATE_FROM_DISK}: the server did not load {where}: "
                               f"{wire.one_line(str(message))}")
        if self.pushed_step is not None and self.pushed_step != step:
            shutil.rmtree(self.adapter_dir / f"merged-step-{self.pushed_step}", ignore_errors=True)
        self.adapter, self.pushed_step = None, step
        return where

    # -- sampling ---------------------------------------------------------------------------------------------------

    def sample(self, prompt_ids: Sequence[Sequence[int]], group_size: int, max_new_tokens: int,
               temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               eos_ids: Sequence[int] = (), vocab_size: int | None = None
               ) -> tuple[list[list[int]], list[list[float]]]:
        """(completions, sampler_logps): `group_size` completions of each prompt, the G of a prompt consecutive
        (`grpo.sample_group`'s rows), each its token ids [n_i] ending with its stop token (one of `eos_ids`, or the
        server's EOS) when it stopped, as `generate(include_stop=True)`; and the sampler's log-prob of each of
        them [n_i] (NaN where the server reported none). Token ids are checked against `vocab_size` when given.
        vLLM: one `/v1/completions` request with `n` and `seed`; SGLang: one `/generate` of the prompts repeated
        (SGLang takes no seed there)."""
        if not prompt_ids or any(not p for p in prompt_ids):
            raise JaxtuneError("external sampler: no prompts, or an empty prompt")
        rows = len(prompt_ids) * group_size
        try:
            if self.server == "sglang":  # SGLang's token path (its /v1/completions answers tokens as text)
                repeated = [p for p in prompt_ids for _ in range(group_size)]
                body = wire.generate_request(self.adapter, repeated, max_new_tokens, temperature, top_k, top_p,
                                             eos_ids)
                return wire.read_generate(self.request("POST", wire.GENERATE, body), rows, vocab_size)
            body = wire.completion_request(self.adapter or self.model, prompt_ids, group_size, max_new_tokens,
                                           temperature, top_k, top_p, seed, eos_ids)
            return wire.read_completions(self.request("POST", wire.COMPLETIONS, body), rows, vocab_size)
        except wire.ProtocolError as e:
            path = wire.GENERATE if self.server == "sglang" else wire.COMPLETIONS
            raise JaxtuneError(f"POST {self.url}{path}: {e}") from None


def sample_group_external(sampler: ExternalSampler, params: dict, cfg: ModelConfig, method: MethodConfig | None,
                          prompts: list[list[int]], rollout, seed: int, eos_ids: Sequence[int], step: int = 0,
                          push_every: int = 1, weights: str = "lora"
                          ) -> tuple[list[list[int]], list[list[int]], list[list[float]]]:
    """`grpo.sample_group` from an external sampler: (prompt of each row, completion of each row, the sampler's
    per-token log-probs of each completion), G = rollout.group_size rows a prompt, consecutive; a completion that
    stopped ends with its EOS. The policy `params` is pushed first when `step` (the rollout batch's number) is a
    multiple of `push_every` or nothing was pushed yet ("lora": `push_adapter`; "merged": `push_merged`). The third
    list is what `rollout_batch(..., sampler_logps=)` takes. rollout: a `RolloutConfig` (group_size,
    max_new_tokens, temperature, top_k, top_p)."""
    if sampler.pushed_step is None or step % push_every == 0:
        if weights == "merged":
            sampler.push_merged(params, method, cfg, step)
        else:
            if method is None or method_unit(method).peft is None or method_unit(method).trains_base:
                kind = "a full fine-tune" if method is None else repr(method.kind)
                raise JaxtuneError(f"external sampler: {kind} has no PEFT adapter to push; use sampler_weights = "
                                   "\"merged\" (SGLang)")
            sampler.push_adapter(params, method, cfg, step)
    repeated = [list(p) for p in prompts for _ in range(rollout.group_size)]
    completions, logps = sampler.sample(prompts, rollout.group_size, rollout.max_new_tokens, rollout.temperature,
                                        rollout.top_k, rollout.top_p, seed, eos_ids, vocab_size=cfg.vocab_size)
    return repeated, completions, logps
