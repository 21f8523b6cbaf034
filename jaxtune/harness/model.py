"""`JaxtuneLM`: jaxtune's model behind lm-evaluation-harness's `LM` interface, registered as `jaxtune`.

    lm_eval.simple_evaluate(model="jaxtune", model_args="model=DIR_OR_GGUF,adapter=RUN/adapter", tasks=[...])

Tokenisation follows lm-eval's `hf` model (its `TemplateLM` splits context and continuation; BOS as the tokenizer
adds it), so requests are the same token ids; `loglikelihood` scores them packed (`scoring.score_requests`),
`loglikelihood_rolling` over lm-eval's disjoint windows, and `generate_until` through jaxtune's generation engine.
A vision-language directory also takes multimodal tasks (`MULTIMODAL`, as lm-eval's `hf-multimodal`; `images.py`).
"""

from __future__ import annotations

import dataclasses
import sys
from contextlib import nullcontext
from pathlib import Path

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxtune.config import ForwardOptions, MeshConfig, SamplingConfig
from jaxtune.data.formats import render_chat
from jaxtune.data.tokenizer import load_tokenizer
from jaxtune.errors import JaxtuneError
from jaxtune.generation import generate
from jaxtune.harness.images import image_chat, marked_text, request_images, score_with_images
from jaxtune.harness.scoring import score_requests
from jaxtune.image_generation import ImageGenerator, eos_ids, generate_batch_with_images, text_ids
from jaxtune.models.vision.families import image_processor
from jaxtune.parallel.mesh import make_mesh
from jaxtune.spine.model import load_model_with_adapter
from jaxtune.stop_strings import StopStrings

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf model's


def _as_bool(key: str, value) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise JaxtuneError(f"model_args: {key}={value!r} is not true or false")


def _as_int(key: str, value, low: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < low or str(number) != str(value).strip():
        raise JaxtuneError(f"model_args: {key}={value!r} is not an integer >= {low}")
    return number


def _with_images(request) -> bool:
    """Whether an lm-eval request carries images (a multimodal task's third argument)."""
    return len(request.args) > 2


@register_model("jaxtune")
class JaxtuneLM(TemplateLM):
    """An lm-eval model over jaxtune's forward. model_args (lm-eval's `key=value,...`):

    model (or pretrained): a Hugging Face directory or a .gguf file. adapter: a PEFT or jaxtune run adapter
    directory. base: as-trained | float (a QLoRA adapter's base). compute_dtype: float32 | bfloat16.
    batch_size: generation rows a batch (lm-eval's --batch_size; default 16). batch_tokens: packed tokens a
    scoring forward (default 4096). max_length: the context (default the model's). max_gen_toks: default 256.
    add_bos_token: as lm-eval's hf model (default: as the tokenizer adds it). fsdp, tensor: a mesh of fsdp x tensor
    devices the weights are split over (ZeRO-3's and tensor parallelism's layout; default one device).
    compile_cache: a directory where XLA's compiled programs are kept (JAX's persistent compilation cache, for the
    whole process), so that a later evaluation with the same shapes loads them instead of compiling.
    A vision-language directory's model reads requests' images (`MULTIMODAL` True): lm-eval's `<image>` becomes its
    chat template's image marker (Gemma 3's `<start_of_image>`, Qwen2.5-VL's `<|image_pad|>`), expanded as its
    processor does.
    """

    def __init__(self, model: str | None = None, pretrained: str | None = None, adapter: str | None = None,
                 base: str = "as-trained", compute_dtype: str = "float32", batch_size=16, batch_tokens=4096,
                 max_length=None, max_gen_toks=DEFAULT_MAX_GEN_TOKS, add_bos_token=None, fsdp=1, tensor=1,
                 compile_cache=None, **unknown):
        super().__init__()
        for key in ("device", "max_batch_size", "trust_remote_code", "dtype"):  # lm-eval's defaults for every model
            unknown.pop(key, None)
        if unknown:
            raise JaxtuneError(f"model_args: unknown key {sorted(unknown)[0]!r} (jaxtune takes model, adapter, base, "
                               "compute_dtype, batch_size, batch_tokens, max_length, max_gen_toks, add_bos_token, "
                               "fsdp, tensor, compile_cache)")
        path = model or pretrained
        if not path:
            raise JaxtuneError("model_args: model=DIR_OR_GGUF is required (a Hugging Face directory or .gguf file)")
        if compile_cache:
            cache = Path(compile_cache).expanduser()
            if cache.exists() and not cache.is_dir():
                raise JaxtuneError(f"model_args: compile_cache={compile_cache!r} is a file, not a directory")
            jax.config.update("jax_compilation_cache_dir", str(cache))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # each program: a second or less
        ways = {"fsdp": _as_int("fsdp", fsdp), "tensor": _as_int("tensor", tensor)}
        if ways["fsdp"] * ways["tensor"] > len(jax.devices()):
            raise JaxtuneError(f"model_args: fsdp={ways['fsdp']} x tensor={ways['tensor']} needs more devices than "
                               f"the {len(jax.devices())} there are")
        mesh = (make_mesh(MeshConfig(**ways), jax.devices()[: ways["fsdp"] * ways["tensor"]])
                if ways["fsdp"] * ways["tensor"] > 1 else None)
        cfg, params, method = load_model_with_adapter(path, adapter, base=base, mesh=mesh,
                                                      log=lambda text: print(text, file=sys.stderr))
        tokenizer = load_tokenizer(path)
        processor = image_processor(path, tokenizer)
        images = None if processor is None else ImageGenerator(
            cfg, params, processor.family.read_params(path, processor.config, params["embed_tokens"].dtype), processor,
            method)
        self._setup(cfg, params, method, tokenizer, str(path), ForwardOptions(compute_dtype=compute_dtype),
                    batch_size=batch_size, batch_tokens=batch_tokens, max_length=max_length,
                    max_gen_toks=max_gen_toks, add_bos_token=add_bos_token, mesh=mesh, images=images)

    @classmethod
    def from_params(cls, cfg, params: dict, method, tokenizer, name: str, options: ForwardOptions = ForwardOptions(),
                    **settings) -> JaxtuneLM:
        """The model of parameters already in memory (a training run's): `settings` as the model_args, `mesh`, the
        one the parameters are split over (None: one device), and `images`, a vision-language model's
        `ImageGenerator` (None: text only)."""
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(cfg, params, method, tokenizer, name, options, **settings)
        return lm

    def _setup(self, cfg, params, method, tokenizer, name: str, options: ForwardOptions, batch_size=16,
               batch_tokens=4096, max_length=None, max_gen_toks=DEFAULT_MAX_GEN_TOKS, add_bos_token=None,
               mesh=None, images: ImageGenerator | None = None) -> None:
        self.cfg, self.params, self.method, self.tokenizer = cfg, params, method, tokenizer
        self.images = images
        self.MULTIMODAL = images is not None  # lm-eval runs a task with images only on a model that says so
        # traced under the weights' mesh, so each layer's rows are split as in training (`rules.constrain`)
        self._traced = (lambda: jax.sharding.use_abstract_mesh(mesh.abstract_mesh)) if mesh is not None else nullcontext
        self.model_path, self.options = name, options
        auto = batch_size is None or str(batch_size).startswith("auto")  # lm-eval's "auto": our default
        self.batch_rows = _as_int("batch_size", 16 if auto else batch_size)
        self.batch_tokens = _as_int("batch_tokens", batch_tokens)
        self._max_length = cfg.max_position_embeddings if max_length is None else _as_int("max_length", max_length, 2)
        self._max_gen_toks = _as_int("max_gen_toks", max_gen_toks)
        self.add_bos_token = _as_bool("add_bos_token", add_bos_token)
        self._eot = int(tokenizer.eos_id if tokenizer.eos_id is not None else cfg.eos_token_id[0])
        # generation ends at these: the text model's EOS; with images, the model's too (as its `generate` stops)
        self._stops = {self._eot} if images is None else {self._eot, *eos_ids(images)}

    # What TemplateLM asks -----------------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.model_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's hf model: the flag if given, else add_bos_token, else the tokenizer's default (special
        tokens added), but never a second BOS before a string that starts with one."""
        if add_special_tokens is None:
            add_special_tokens = self._adds_special_tokens(string)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def _adds_special_tokens(self, string: str) -> bool:
        bos = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
        return False if bos and string.startswith(bos) else True if self.add_bos_token is None else self.add_bos_token

    def _image_ids(self, request, text: str) -> tuple[list[int], np.ndarray]:
        """(ids, pixel arrays [N, ...]) of a request's `text` with its images, `<image>` as the model's marker."""
        assert self.images is not None
        images = request_images(request)
        marked = marked_text(text, self.images.processor.marker, len(images),
                             f"task {request.task_name}, doc {request.doc_id}")
        return text_ids(self.images.processor, marked, images, add_special_tokens=self._adds_special_tokens(marked))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered by the tokenizer's template; a vision-language model's turns split at `<image>` into
        image parts (`images.image_chat`), as hf-multimodal's."""
        if self.images is not None:
            chat_history = image_chat(chat_history)
        return render_chat(chat_history, self.tokenizer, add_generation_prompt=add_generation_prompt)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    # Scoring -------------------------------------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p, greedy) of each continuation; with images (a multimodal task), the context's images in the
        model's view, the pair split as hf-multimodal splits it (the context's trailing spaces go with the
        continuation; its ids are the whole text's after the context's)."""
        text = [i for i, request in enumerate(requests) if not _with_images(request)]
        imaged = [i for i, request in enumerate(requests) if _with_images(request)]
        results = [(0.0, False)] * len(requests)
        for i, answer in zip(text, super().loglikelihood([requests[i] for i in text], disable_tqdm) if text else []):
            results[i] = answer
        for i, answer in zip(imaged, self._loglikelihood_with_images([requests[i] for i in imaged]) if imaged else []):
            results[i] = answer
        return results

    def _loglikelihood_with_images(self, requests: list) -> list[tuple[float, bool]]:
        assert self.images is not None
        pairs = []
        for request in requests:
            context, continuation = request.args[0], request.args[1]
            spaces = len(context) - len(context.rstrip())
            context, continuation = context[: len(context) - spaces], context[len(context) - spaces:] + continuation
            whole, pixels = self._image_ids(request, context + continuation)
            own, _ = self._image_ids(request, context)
            if len(whole) > self.max_length:
                raise JaxtuneError(f"task {request.task_name}, doc {request.doc_id}: {len(whole)} tokens with its "
                                   f"images, more than max_length {self.max_length} (images are never cut)")
            pairs.append((own, whole[len(own):], pixels))
        with self._traced():
            results = score_with_images(self.images, pairs, self.options, self.batch_rows)
        for request, answer in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, answer)
        return results

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log p, greedy) per ((context, continuation), context ids, continuation ids), cut on the left to the
        context + 1 tokens as lm-eval's hf model cuts them."""
        pairs = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            pairs.append((whole[: len(whole) - len(continuation)], whole[len(whole) - len(continuation):]))
        with self._traced():
            results = score_requests(self.params, self.cfg, pairs, method=self.method, options=self.options,
                                     batch_tokens=max(self.batch_tokens, self.max_length))
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The whole text's log-likelihood, over lm-eval's disjoint windows of `max_length` tokens."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # Generation ----------------------------------------------------------------------------------------------------

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation up to the first of its `until` strings (and EOS), greedy unless the request
        samples; requests with the same generation arguments share batches (one prefill shape), in token order.
        With images (a multimodal task), each context's own images; the rows decode to EOS or the limit, then are
        cut at the strings (as hf-multimodal cuts them)."""
        eos_text = self.tokenizer.decode([self._eot], skip_special_tokens=False)
        groups: dict[tuple[bool, str], list[int]] = {}  # a multimodal task's requests apart from a text task's
        for i, req in enumerate(requests):
            groups.setdefault((_with_images(req), repr(sorted(req.args[1].items()))), []).append(i)
        results = [""] * len(requests)  # each request's group fills it
        for (images, _), members in groups.items():
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            sampling = self._sampling(kwargs, max_new)
            if images:
                new = self._generate_with_images([requests[i] for i in members], until, sampling)
                order = members
            else:
                new, order = self._generate_text([requests[i].args[0] for i in members], members, until, sampling)
            for i, tokens in zip(order, new):
                tokens = tokens[:-1] if tokens and tokens[-1] in self._stops else tokens
                text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True), until, None)
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate_text(self, contexts: list[str], members: list[int], until: list[str], sampling: SamplingConfig
                       ) -> tuple[list[list[int]], list[int]]:
        """(each context's new tokens, the members in that order: by their ids, so that neighbours in a batch share
        the longest prefixes); a row stops decoding once its text holds one of `until`."""
        ids = {i: self.tok_encode(text)[-(self.max_length - sampling.max_new_tokens):]
               for i, text in zip(members, contexts)}
        order = sorted(members, key=lambda i: ids[i])
        stops = StopStrings.of(self.tokenizer, until, len(order))
        with self._traced():  # a token whose own text holds one ends its row at once
            new = generate(self.params, self.cfg, [ids[i] for i in order], sampling, eos_ids=[self._eot],
                           stop_token_ids=stops.token_ids(), include_stop=True, method=self.method,
                           options=self.options, stop_when=stops if stops.any else None, batch_rows=self.batch_rows)
        return new, order

    def _generate_with_images(self, requests: list, until: list[str], sampling: SamplingConfig) -> list[list[int]]:
        """Each request's new tokens after its context with its images, `batch_rows` prompts decoded together; a
        row stops decoding once its text holds one of `until` (checked every 16 steps)."""
        assert self.images is not None
        prompts = [self._image_ids(request, request.args[0]) for request in requests]
        for request, (ids, _) in zip(requests, prompts):
            if len(ids) + sampling.max_new_tokens > self.max_length:
                raise JaxtuneError(f"task {request.task_name}, doc {request.doc_id}: {len(ids)} tokens with its images "
                                   f"and {sampling.max_new_tokens} new ones pass max_length {self.max_length} (images "
                                   "are never cut)")
        new: list[list[int]] = []
        for at in range(0, len(prompts), self.batch_rows):
            batch = prompts[at:at + self.batch_rows]
            stops = StopStrings.of(self.tokenizer, until, len(batch))
            with self._traced():
                new += generate_batch_with_images(self.images, batch, sampling, sorted(self._stops), self.options,
                                                  stop_when=stops if stops.any else None)
        return new

    def _sampling(self, kwargs: dict, max_new_tokens: int) -> SamplingConfig:
        """The request's decoding: greedy unless do_sample with a temperature > 0."""
        sampling = SamplingConfig(max_new_tokens=max_new_tokens)
        if kwargs.pop("do_sample", False) and float(kwargs.get("temperature", 0.0)) > 0:
            sampling = dataclasses.replace(sampling, temperature=float(kwargs["temperature"]),
                                           top_p=float(kwargs.get("top_p", 1.0)), top_k=int(kwargs.get("top_k", 0)),
                                           seed=int(kwargs.get("seed", 0)))
        return sampling
