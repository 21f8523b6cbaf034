"""A sampling server for tests that speaks what `jaxtune.rollouts.openai_protocol` follows (vLLM's OpenAI server and
runtime LoRA routes, SGLang's LoRA routes and `update_weights_from_disk`), over a tiny jaxtune model on 127.0.0.1.

It is jaxtune on the inside, so a round trip is real: a pushed adapter is read with jaxtune's own PEFT loader
(`load_peft_adapter`), merged weights with `spine.model.load_model`, completions come from `generation.generate`
(include_stop: the stop token kept, as vLLM keeps it), and each sampled token's log-prob from a forward pass of
prompt + completion at the request's temperature (vLLM's `--logprobs-mode processed_logprobs`).
`FakeSampler.fault` makes it misbehave for the error tests: "http_error", "malformed", "no_logprobs", "bad_token",
"slow" (sleeps `slow_s` before answering)."""

from __future__ import annotations

import functools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jax
import numpy as np

from jaxtune.config import ForwardOptions, SamplingConfig
from jaxtune.generation import generate
from jaxtune.methods.peft import load_peft_adapter
from jaxtune.models.head import label_logps
from jaxtune.models.llama import decoder


def sampled_logps(params, cfg, method, prompts, completions, temperature: float) -> list[list[float]]:
    """log p(token) [n_i] of each completion's tokens after its prompt, of the logits / temperature."""
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    T = max(len(r) for r in rows) - 1
    ids, labels = np.zeros((len(rows), T), np.int32), np.zeros((len(rows), T), np.int32)
    segments = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r) - 1], labels[i, :len(r) - 1], segments[i, :len(r) - 1] = r[:-1], r[1:], 1
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), ids.shape)
    logps = np.asarray(_label_logps(params, ids, labels, positions, segments, cfg, method, temperature))
    return [logps[i, len(p) - 1:len(p) - 1 + len(c)].tolist() for i, (p, c) in enumerate(zip(prompts, completions))]


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _label_logps(params, ids_BxT, labels_BxT, positions_BxT, segments_BxT, cfg, method, temperature: float):
    hidden = decoder(params, ids_BxT, cfg, positions_BxT=positions_BxT, segment_ids_BxT=segments_BxT, method=method,
                     options=ForwardOptions())
    return label_logps(params, hidden, labels_BxT, cfg.final_logit_softcap, temperature)


class FakeSampler:
    """The server's state: the base model, the adapters loaded by name, what was asked of it (`log`)."""

    def __init__(self, cfg, params, model: str = "tiny-base"):
        self.cfg, self.base, self.model = cfg, params, model
        self.adapters: dict[str, tuple] = {}  # name -> (method, params, path)
        self.log: list[tuple[str, dict]] = []
        self.fault: str | None = None
        self.slow_s = 2.0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.httpd.shutdown()
        self.httpd.server_close()

    # each returns (status, JSON-able body or text)
    def models(self, _):
        return 200, {"object": "list", "data": [{"id": self.model, "object": "model"},
                                                *({"id": n, "object": "model", "parent": self.model, "root": a[2]}
                                                  for n, a in self.adapters.items())]}

    def load_lora(self, body):
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return 400, {"error": {"message": "Both 'lora_name' and 'lora_path' must be provided.", "code": 400}}
        if name in self.adapters and not body.get("load_inplace"):
            return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.", "code": 400}}
        method, params = load_peft_adapter(path, self.base, self.cfg)
        self.adapters[name] = (method, params, path)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora(self, body):
        name = body.get("lora_name")
        if name not in self.adapters:
            return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}}
        del self.adapters[name]
        return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def update_from_disk(self, body):
        from jaxtune.spine.model import load_model

        _, self.base = load_model(body["model_path"])
        return 200, {"success": True, "message": "Succeeded to update model weights."}

    def completions(self, body):
        name = body.get("model")
        if name == self.model:
            method, params = None, self.base
        elif name in self.adapters:
            method, params, _ = self.adapters[name]
        else:
            return 404, {"error": {"message": f"The model `{name}` does not exist.", "code": 404}}
        prompts = body["prompt"]
        prompts = [prompts] if prompts and isinstance(prompts[0], int) else prompts
        n, t = body.get("n", 1), body.get("temperature", 1.0)
        eos = sorted({*self.cfg.eos_token_id, *body.get("stop_token_ids", [])})
        sampling = SamplingConfig(max_new_tokens=body.get("max_tokens", 16), temperature=t,
                                  top_k=max(body.get("top_k", 0), 0),  # -1: all, as vLLM and SGLang read it
                                  top_p=body.get("top_p", 1.0), seed=body.get("seed") or 0)
        repeated = [p for p in prompts for _ in range(n)]
        completions = generate(params, self.cfg, repeated, sampling, eos_ids=eos, method=method, include_stop=True)
        logps = sampled_logps(params, self.cfg, method, repeated, completions, t if t > 0 else 1.0)
        choices = []
        for i, (ids, values) in enumerate(zip(completions, logps)):
            stopped = bool(ids) and ids[-1] in eos
            if self.fault == "bad_token":
                ids = [*ids[:-1], self.cfg.vocab_size + 7]
            logprobs = {"tokens": [f"token_id:{k}" for k in ids], "token_logprobs": values, "top_logprobs": None,
                        "text_offset": list(range(len(ids)))}
            choices.append({"index": i, "text": "", "logprobs": None if self.fault == "no_logprobs" else logprobs,
                            "finish_reason": "stop" if stopped else "length",
                            "stop_reason": ids[-1] if stopped and ids[-1] not in self.cfg.eos_token_id else None})
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": name, "choices": choices}


def _generate(state: FakeSampler, body):
    """SGLang's `/generate` over the same sampling: a row each, `meta_info.output_token_logprobs`."""
    params = body.get("sampling_params", {})
    adapters = body.get("lora_path") or [None]
    status, reply = state.completions({
        "model": adapters[0] or state.model, "prompt": body["input_ids"], "n": 1,
        "max_tokens": params.get("max_new_tokens", 16), "temperature": params.get("temperature", 1.0),
        "top_k": params.get("top_k", -1), "top_p": params.get("top_p", 1.0),
        "stop_token_ids": params.get("stop_token_ids", [])})
    if status != 200:
        return status, reply
    return 200, [{"text": "", "meta_info": {
        "output_token_logprobs": [[lp, int(t.split(":")[1]), None]
                                  for lp, t in zip(c["logprobs"]["token_logprobs"], c["logprobs"]["tokens"])],
        "finish_reason": {"type": c["finish_reason"]}}} for c in reply["choices"]]


def _handler(state: FakeSampler):
    routes = {("GET", "/health"): lambda _: (200, ""), ("GET", "/v1/models"): state.models,
              ("POST", "/v1/load_lora_adapter"): state.load_lora,
              ("POST", "/v1/unload_lora_adapter"): state.unload_lora,
              ("POST", "/load_lora_adapter"): state.load_lora, ("POST", "/unload_lora_adapter"): state.unload_lora,
              ("POST", "/update_weights_from_disk"): state.update_from_disk,
              ("POST", "/v1/completions"): state.completions, ("POST", "/generate"): lambda b: _generate(state, b)}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):  # quiet
            pass

        def _serve(self, verb: str):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else {}
            route = routes.get((verb, self.path))
            state.log.append((self.path, body))
            if state.fault == "slow":  # a server that answers too late, computing nothing meanwhile
                time.sleep(state.slow_s)
                status, reply = 503, {"error": {"message": "late"}}
            elif route is None:
                status, reply = 404, {"detail": "Not Found"}
            elif state.fault == "http_error" and self.path == "/v1/completions":
                status, reply = 500, {"error": {"message": "CUDA out of memory.\nTried to allocate 2 GiB", "code": 500}}
            else:
                with state.lock:
                    status, reply = route(body)
            data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
            if state.fault == "malformed" and self.path == "/v1/completions":
                data = b"<html>502 Bad Gateway</html>"
            self.send_response(status)
            self.send_header("Content-Type", "text/plain" if isinstance(reply, str) else "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._serve("GET")

        def do_POST(self):
            self._serve("POST")

    return Handler

