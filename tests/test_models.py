"""models/: configs, the MoE transformer, the corpus and tokenizer, and the training loop (steps, checkpoints, EP)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from models import data
from models.configs import CONFIGS, get_config
from models.train import Trainer, restore_checkpoint, save_checkpoint, checkpoint_manager
from models.transformer import MoETransformer

# Small enough to compile in seconds on 2 cores; two layers so one is dense (moe_every=2) in some tests.
MICRO = dict(hidden=32, num_layers=2, num_heads=2, dense_intermediate=48, num_experts=4, top_k=2,
             expert_intermediate=32, seq_len=16, batch_size=4, steps=40, warmup_steps=2, eval_every=40,
             learning_rate=1e-2)


def _batch(config, seed):
  tokens, _ = data.train_eval_split(data.load_documents())
  return data.Batches(tokens, config.batch_size, config.seq_len, seed).at(0)


def test_all_named_configs_validate():
  for name in CONFIGS:
    config = get_config(name)
    assert config.hidden % config.num_heads == 0 and config.top_k <= config.num_experts
  geometry = {name: (c.hidden, c.expert_intermediate, c.top_k) for name, c in CONFIGS.items()}
  assert geometry["kimi-k2-geom"] == (7168, 2048, 8) and geometry["qwen3.5-geom"] == (4096, 1024, 10)


@pytest.mark.parametrize("overrides,match", [
    (dict(num_heads=3), "num_heads=3 must divide hidden=128"),
    (dict(top_k=9), "top_k=9 must be <= num_experts=8"),
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(moe_every=3), "leaves no MoE layer"),
    (dict(score="tanh"), "score must be one of"),
    (dict(dtype="float16"), "dtype must be"),
    (dict(warmup_steps=500, steps=100), "warmup_steps=500"),
    (dict(nonsense=1), "unknown config fields"),
])
def test_bad_configs_raise(overrides, match):
  with pytest.raises(ValueError, match=match):
    get_config("tiny", **overrides)
  with pytest.raises(ValueError, match="unknown config"):
    get_config("huge")


def test_model_output_shapes_and_dense_layers():
  config = get_config("tiny", **MICRO, moe_every=2, shared_intermediate=16)
  model = MoETransformer(config, backend="xla", rngs=nnx.Rngs(0))
  logits, aux = model(np.zeros((3, 10), np.int32))
  assert logits.shape == (3, 10, data.VOCAB_SIZE) and len(aux) == 1  # layer 1 is MoE, layer 0 dense
  assert [block.is_moe for block in model.blocks] == [False, True]


def test_tokenizer_and_corpus():
  text = "We the People — 1787"
  assert data.decode(data.encode(text)) == text
  train, evaluation = data.train_eval_split(data.load_documents())
  assert train.dtype == np.int32 and len(evaluation) > 0 and train.max() < data.VOCAB_SIZE
  counts = np.bincount(train).astype(np.float64)
  probs = counts[counts > 0] / counts.sum()
  assert data.unigram_entropy(train) == pytest.approx(-(probs * np.log(probs)).sum())
  batches = data.Batches(train, 4, 16, seed=1)
  np.testing.assert_array_equal(batches.at(3), batches.at(3))
  assert batches.at(3).shape == (4, 17)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_training_steps_lower_the_loss(score):
  config = get_config("tiny", **MICRO, score=score)
  trainer = Trainer(config, backend="xla", devices=jax.devices("cpu")[:1])
  state = trainer.init_state()
  batch = trainer.place_batch(_batch(config, 0))
  losses = []
  for _ in range(12):
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 1.0, losses
  biases = jax.tree.leaves(state.router_state)
  if score == "sigmoid":  # the aux-loss-free update moved the biases
    assert biases and all(float(np.abs(b).max()) > 0 for b in biases)
  else:
    assert not biases


def test_checkpoint_round_trip_resumes_to_the_same_loss(tmp_path):
  config = get_config("tiny", **MICRO, score="sigmoid")
  cpu = jax.devices("cpu")[:1]
  trainer = Trainer(config, backend="xla", devices=cpu)
  batches = [trainer.place_batch(_batch(config, seed)) for seed in range(3)]
  state = trainer.init_state()
  state, _ = trainer.train_step(state, batches[0])
  state, _ = trainer.train_step(state, batches[1])
  save_checkpoint(checkpoint_manager(tmp_path), state)
  _, continued = trainer.train_step(state, batches[2])

  fresh = Trainer(config, backend="xla", devices=cpu, seed=123)  # other init: everything must come from disk
  restored = restore_checkpoint(checkpoint_manager(tmp_path), fresh.init_state())
  assert int(restored.step) == 2
  _, resumed = fresh.train_step(restored, batches[2])
  assert float(resumed["loss"]) == float(continued["loss"])


def test_expert_parallel_mesh_matches_one_device():
  """4 host devices, experts split over them (EP through moe_ffn(axis_name=...)) and tokens data-parallel: the
  same losses step after step and the same gradients. The load-balancing loss is left out of the gradient check: each
  data shard balances its own tokens (f_e and P_e per shard, then averaged), so it differs from one device's."""
  config = get_config("tiny", **MICRO, load_balancing_weight=0.0, dtype="float32")  # "auto": bf16 on a GPU machine
  devices = jax.devices("cpu")
  if len(devices) < 4:
    pytest.skip("needs 4 host devices (conftest sets --xla_force_host_platform_device_count=8)")
  single = Trainer(config, backend="xla", devices=devices[:1])
  parallel = Trainer(config, backend="xla", devices=devices[:4])
  assert parallel.expert_parallel
  one, many = single.init_state(), parallel.init_state()
  assert many.params["blocks"][0]["ffn"]["w_gate"].sharding.spec[0] == "data"
  for seed in range(3):
    batch = _batch(config, seed)
    one, metrics_one = single.train_step(one, single.place_batch(batch))
    many, metrics_many = parallel.train_step(many, parallel.place_batch(batch))
    np.testing.assert_allclose(float(metrics_many["loss"]), float(metrics_one["loss"]), rtol=1e-5)
  # Gradients at the same (initial) parameters agree. Parameters after a few Adam steps would not exactly: Adam
  # turns reduction-order noise in ~0 gradients into full-size steps.
  batch = _batch(config, 9)
  grads = [jax.jit(jax.grad(lambda p, t=t, s=s, b=b: t._loss(p, s.router_state, b)[0]))(s.params)
           for t, s, b in ((single, single.init_state(), single.place_batch(batch)),
                           (parallel, parallel.init_state(), parallel.place_batch(batch)))]
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-3, atol=1e-6)


def test_bad_trainer_arguments_raise():
  config = dataclasses.replace(get_config("tiny", **MICRO), batch_size=3)
  with pytest.raises(ValueError, match="batch_size=3 must be a multiple of the 2 devices"):
    Trainer(config, devices=jax.devices("cpu")[:2])
  with pytest.raises(ValueError, match="backend must be one of"):
    Trainer(get_config("tiny", **MICRO), backend="triton")
