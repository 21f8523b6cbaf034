"""CPO (and SimPO, its variant) and ORPO with image-conditioned pairs (issue 52): TRL's vision preference records read
as DPO's (`image_preference_examples`), each pair row reading its prompt's images (`dpo.row_logps`). Full tier, on a
tiny Gemma3ForConditionalGeneration: CPO's loss on a pair batch equals TRL's CPO formula (sigmoid loss + cpo_alpha x
the chosen completions' NLL), ORPO's TRL's `nll_loss - odds_ratio_loss(...).mean()`, on transformers' log-probs with
the images; one `fine_tune` step of each runs."""

import dataclasses

import numpy as np
import pytest


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_cpo_with_images_equals_the_cpo_formula_on_transformers_logps(tmp_path):
    import jax
    import torch
    import torch.nn.functional as F
    from test_vision_train import gemma3_run_dir, run_config, write_image_data, write_preference_data

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows
    from jaxtune.data.image_examples import image_preference_examples
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.models.vision.families import image_processor, image_side
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.cpo import CPOConfig, _sums
    from jaxtune.objectives.dpo import pair_batch
    from jaxtune.presets import GEMMA3_IMAGE
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.loop import fine_tune

    model = gemma3_run_dir(tmp_path / "model")
    write_image_data(tmp_path)  # the colour pictures the pairs name
    write_preference_data(tmp_path)
    tokenizer = load_tokenizer(tmp_path / "model")
    processor = image_processor(tmp_path / "model", tokenizer)
    pairs = list(image_preference_examples(tmp_path / "pairs.jsonl", tokenizer, processor, 64))[:3]
    batch = pair_batch(pairs, 3, 64, images=ImageRows(1, processor.pixel_shape))
    cfg, params, _, vision_params = load_vision_language_model(tmp_path / "model")
    section = CPOConfig(beta=0.5, cpo_alpha=1.0)
    ctx = Context(cfg, None, ForwardOptions(), section, images=image_side(tmp_path / "model", 1))
    loss, count, _ = jax.jit(_sums, static_argnums=2)({**params, "vision": vision_params}, batch, ctx)

    def logps(pair, completion):
        ids = torch.tensor([pair.prompt + completion])
        out = model(input_ids=ids, pixel_values=torch.tensor(pair.pixel_values),
                    token_type_ids=(ids == GEMMA3_IMAGE).long())
        return torch.log_softmax(out.logits[0, :-1], -1).gather(1, ids[0, 1:, None])[len(pair.prompt) - 1:, 0]

    with torch.no_grad():
        chosen = [logps(p, p.chosen) for p in pairs]
        rejected = [logps(p, p.rejected) for p in pairs]
        margins = torch.stack([c.sum() - r.sum() for c, r in zip(chosen, rejected)])
        nll = -torch.cat(chosen).mean()
        want = float(-F.logsigmoid(section.beta * margins).mean() + section.cpo_alpha * nll)
    assert float(count) == 3
    np.testing.assert_allclose(float(loss) / float(count), want, rtol=1e-5)

    config = run_config(tmp_path, "lora", 1)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, train=str(tmp_path / "pairs.jsonl"),
                                                                  max_images_per_row=1),
                                 train=dataclasses.replace(config.train, objective="cpo",
                                                           output_dir=str(tmp_path / "cpo"), eval_every=0))
    result = fine_tune(config, log=lambda _: None)
    assert result.step == 1 and np.isfinite(result.train_loss)


@pytest.mark.full
@pytest.mark.reference
@pytest.mark.parity
def test_orpo_with_images_equals_trl_odds_ratio_loss_on_transformers_logps(tmp_path):
    """ORPO (TRL's ORPO reads no images): its loss on a pair batch with images equals TRL's own `odds_ratio_loss` of
    transformers' mean per-token completion log-probs, subtracted from the NLL of the chosen rows (a token mean over
    prompt and completion, the image placeholders among them); one `fine_tune` step of objective orpo runs."""
    from types import SimpleNamespace

    import jax
    import torch
    from test_vision_train import gemma3_run_dir, run_config, write_image_data, write_preference_data
    from trl.experimental.orpo import ORPOTrainer

    from jaxtune.config import ForwardOptions
    from jaxtune.data.batching import ImageRows
    from jaxtune.data.image_examples import image_preference_examples
    from jaxtune.data.tokenizer import load_tokenizer
    from jaxtune.models.vision.families import image_processor, image_side
    from jaxtune.objectives.base import Context
    from jaxtune.objectives.dpo import pair_batch
    from jaxtune.objectives.orpo import ORPOConfig, _sums
    from jaxtune.presets import GEMMA3_IMAGE
    from jaxtune.spine.model import load_vision_language_model
    from jaxtune.train.loop import fine_tune

    model = gemma3_run_dir(tmp_path / "model")
    write_image_data(tmp_path)
    write_preference_data(tmp_path)
    tokenizer = load_tokenizer(tmp_path / "model")
    processor = image_processor(tmp_path / "model", tokenizer)
    pairs = list(image_preference_examples(tmp_path / "pairs.jsonl", tokenizer, processor, 64))[:3]
    batch = pair_batch(pairs, 3, 64, images=ImageRows(1, processor.pixel_shape))
    cfg, params, _, vision_params = load_vision_language_model(tmp_path / "model")
    section = ORPOConfig(beta=0.5)
    ctx = Context(cfg, None, ForwardOptions(), section, images=image_side(tmp_path / "model", 1))
    loss, count, _ = jax.jit(_sums, static_argnums=2)({**params, "vision": vision_params}, batch, ctx)

    def logps(pair, completion):  # log p of every target of prompt + completion [n - 1]
        ids = torch.tensor([pair.prompt + completion])
        out = model(input_ids=ids, pixel_values=torch.tensor(pair.pixel_values),
                    token_type_ids=(ids == GEMMA3_IMAGE).long())
        return torch.log_softmax(out.logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]

    with torch.no_grad():
        chosen = [logps(p, p.chosen) for p in pairs]
        rejected = [logps(p, p.rejected) for p in pairs]
        mean = lambda rows: torch.stack([r[len(p.prompt) - 1:].mean() for r, p in zip(rows, pairs)])
        trl = SimpleNamespace(beta=section.beta, accelerator=SimpleNamespace(device="cpu"))
        losses = ORPOTrainer.odds_ratio_loss(trl, mean(chosen), mean(rejected))[0]
        want = float(-torch.cat(chosen).mean() - losses.mean())
    assert float(count) == 3 and sum(p.prompt.count(GEMMA3_IMAGE) for p in pairs) == 12
    np.testing.assert_allclose(float(loss) / float(count), want, rtol=1e-5)

    config = run_config(tmp_path, "lora", 1)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, train=str(tmp_path / "pairs.jsonl"),
                                                                  max_images_per_row=1),
                                 train=dataclasses.replace(config.train, objective="orpo",
                                                           output_dir=str(tmp_path / "orpo"), eval_every=0))
    result = fine_tune(config, log=lambda _: None)
    assert result.step == 1 and np.isfinite(result.train_loss)
