"""Train the MoE language model on the shipped corpus.

  python3 models/train.py --config tiny [--backend auto|xla|kittens] [--steps N] [--ckpt-dir DIR] [--resume]

Parallelism: one 1-D mesh axis "data" over all devices. Tokens are split over it (data parallel); the routed expert
weights are split over it too when it divides num_experts (expert parallelism: `moe_ffn(axis_name="data")` moves
tokens to their experts), and replicated otherwise. The loss runs inside ``jax.shard_map`` and the gradient is
taken outside it, so JAX sums the replicated parameters' gradients. On one device no mesh is used. The
load-balancing loss is computed per data shard (its own tokens' f_e and P_e) and averaged over shards.

Sigmoid routing: after each optimizer step the router bias of every MoE layer moves by
`jax_kittens.nn.update_router_bias` on the step's expert load summed over all data shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time

if __package__ in (None, ""):
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kittens.moe import BACKENDS, resolve_backend
from models import data
from models.configs import CONFIGS, ModelConfig, get_config
from models.transformer import MoETransformer

AXIS = "data"
_EXPERT_PARAMS = ("w_gate", "w_up", "w_down")


def _leaf_name(path) -> str:
  keys = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)]
  return str(keys[-1])


@dataclasses.dataclass
class TrainState:
  """params: trainable arrays (nested dict); router_state: the non-trainable rest (sigmoid router biases);
  opt_state: optax state; step: int32 scalar. A plain pytree: orbax saves it as is."""

  params: dict
  router_state: dict
  opt_state: optax.OptState
  step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=["params", "router_state", "opt_state", "step"],
                                 meta_fields=[])


class Trainer:
  """Builds the model, mesh, optimizer and the jitted train / eval steps for one config and backend."""

  def __init__(self, config: ModelConfig, *, backend: str = "auto", devices=None, seed: int = 0):
    config.validate()
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    self.config, self.backend, self.seed = config, backend, seed
    self.devices = list(jax.devices() if devices is None else devices)
    num_devices = len(self.devices)
    if config.batch_size % num_devices:
      raise ValueError(f"batch_size={config.batch_size} must be a multiple of the {num_devices} devices")
    self.mesh = jax.sharding.Mesh(np.array(self.devices), (AXIS,)) if num_devices > 1 else None
    self.expert_parallel = self.mesh is not None and config.num_experts % num_devices == 0
    model = MoETransformer(config, backend=backend, axis_name=AXIS if self.expert_parallel else None,
                           rngs=nnx.Rngs(seed))
    self.graphdef, params, router_state = nnx.split(model, nnx.Param, ...)
    self._params_def = jax.tree.structure(params)
    self._router_def = jax.tree.structure(router_state)
    self._init_params = nnx.to_pure_dict(params)
    self._init_router_state = nnx.to_pure_dict(router_state)
    self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self._init_params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps, config.steps,
                                                  end_value=config.learning_rate * 0.1)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731 (no decay on norms)
    self.optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=config.weight_decay,
                                             mask=decay_mask))
    self.train_step = jax.jit(self._train_step, donate_argnums=0)
    self.eval_step = jax.jit(self._eval_loss)

  # --- placement -----------------------------------------------------------------------------------------------
  def _spec(self, path, _) -> P:
    return P(AXIS) if self.expert_parallel and _leaf_name(path) in _EXPERT_PARAMS else P()

  def param_specs(self, params):
    return jax.tree_util.tree_map_with_path(self._spec, params)

  def _place(self, tree, specs):
    if self.mesh is None:
      return jax.device_put(tree, self.devices[0])
    return jax.device_put(tree, jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs))

  def place_batch(self, batch: np.ndarray) -> jax.Array:
    if self.mesh is None:
      return jax.device_put(jnp.asarray(batch), self.devices[0])
    return jax.device_put(jnp.asarray(batch), NamedSharding(self.mesh, P(AXIS)))

  def init_state(self) -> TrainState:
    """Fresh parameters (from ``seed``), zero router biases, optimizer state, step 0, placed on the mesh."""
    # Copies: the train step donates its state, and device_put to the arrays' own device would not copy.
    params = self._place(jax.tree.map(jnp.array, self._init_params), self.param_specs(self._init_params))
    router_state = self._place(self._init_router_state, jax.tree.map(lambda _: P(), self._init_router_state))
    opt_state = jax.jit(self.optimizer.init)(params)
    state = TrainState(params, router_state, opt_state, jnp.zeros((), jnp.int32))
    # Commit every leaf to its device(s) as the train step's outputs are, or the second step would compile again.
    if self.mesh is None:
      return jax.device_put(state, self.devices[0])
    replicated = NamedSharding(self.mesh, P())
    return dataclasses.replace(state, opt_state=jax.tree.map(
        lambda x: x if x.sharding.is_fully_addressable and x.committed else jax.device_put(x, replicated), opt_state),
        step=jax.device_put(state.step, replicated))

  # --- the model's loss ----------------------------------------------------------------------------------------
  def _merge(self, params, router_state) -> MoETransformer:
    return nnx.merge(self.graphdef, jax.tree.unflatten(self._params_def, jax.tree.leaves(params)),
                     jax.tree.unflatten(self._router_def, jax.tree.leaves(router_state)))

  def _local_loss(self, params, router_state, batch):
    """batch: [b, S + 1] int32 -> (total loss, (cross entropy, load-balancing, z-loss, load [L_moe, E]))."""
    logits, aux = self._merge(params, router_state)(batch[:, :-1])
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    balance = jnp.mean(jnp.stack([a.load_balancing_loss for a in aux]))
    z_loss = jnp.mean(jnp.stack([a.router_z_loss for a in aux]))
    load = jnp.stack([a.expert_load for a in aux])
    if self.mesh is not None:
      cross_entropy, balance, z_loss = (jax.lax.pmean(v, AXIS) for v in (cross_entropy, balance, z_loss))
      load = jax.lax.psum(load, AXIS)
    total = cross_entropy + self.config.load_balancing_weight * balance + self.config.router_z_weight * z_loss
    return total, (cross_entropy, balance, z_loss, load)

  def _loss(self, params, router_state, batch):
    if self.mesh is None:
      return self._local_loss(params, router_state, batch)
    return jax.shard_map(self._local_loss, mesh=self.mesh,
                         in_specs=(self.param_specs(params), jax.tree.map(lambda _: P(), router_state), P(AXIS)),
                         out_specs=(P(), (P(), P(), P(), P())))(params, router_state, batch)

  def _train_step(self, state: TrainState, batch):
    (_, (cross_entropy, balance, z_loss, load)), grads = jax.value_and_grad(self._loss, has_aux=True)(
        state.params, state.router_state, batch)
    updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    router_state = self._updated_router_state(state, load)
    metrics = {"loss": cross_entropy, "load_balancing_loss": balance, "router_z_loss": z_loss,
               "max_load_fraction": jnp.max(load) / jnp.sum(load[0])}
    return TrainState(params, router_state, opt_state, state.step + 1), metrics

  def _updated_router_state(self, state, load):
    """Applies the aux-loss-free bias update of every sigmoid MoE layer (load: [L_moe, E], global counts)."""
    if not jax.tree.leaves(state.router_state):
      return state.router_state
    model = self._merge(state.params, state.router_state)
    moe_blocks = [block for block in model.blocks if block.is_moe]
    for block, layer_load in zip(moe_blocks, load):
      block.ffn.apply_bias_update(layer_load, self.config.bias_update_rate)
    return nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[2])

  def _eval_loss(self, state: TrainState, batch):
    return self._loss(state.params, state.router_state, batch)[1][0]

  def evaluate(self, state: TrainState, batches) -> float:
    return float(np.mean([float(self.eval_step(state, self.place_batch(b))) for b in batches]))


# --- checkpoints -------------------------------------------------------------------------------------------------
def checkpoint_manager(directory: pathlib.Path):
  import orbax.checkpoint as ocp  # noqa: PLC0415 (only runs that checkpoint pay for the import)

  return ocp.CheckpointManager(directory.resolve(), options=ocp.CheckpointManagerOptions(max_to_keep=2))


def save_checkpoint(manager, state: TrainState) -> None:
  import orbax.checkpoint as ocp  # noqa: PLC0415

  manager.save(int(state.step), args=ocp.args.StandardSave(state))
  manager.wait_until_finished()


def restore_checkpoint(manager, target: TrainState) -> TrainState:
  """The latest checkpoint restored into ``target``'s structure, shapes and shardings."""
  import orbax.checkpoint as ocp  # noqa: PLC0415

  step = manager.latest_step()
  if step is None:
    raise FileNotFoundError(f"--resume: no checkpoint in {manager.directory}")
  return manager.restore(step, args=ocp.args.StandardRestore(target))


# --- progress ----------------------------------------------------------------------------------------------------
class Progress:
  """tqdm bar when tqdm is installed, else a line every ~10% of the run."""

  def __init__(self, total: int, initial: int):
    try:
      from tqdm import tqdm  # noqa: PLC0415
      self.bar = tqdm(total=total, initial=initial, dynamic_ncols=True, mininterval=0.5)
    except ImportError:
      self.bar = None
    self.total, self.every = total, max(1, total // 10)

  def update(self, step: int, text: str) -> None:
    if self.bar is not None:
      self.bar.update(1)
      self.bar.set_postfix_str(text, refresh=False)
    elif step % self.every == 0 or step == self.total:
      print(f"step {step}/{self.total} {text}", flush=True)

  def write(self, text: str) -> None:
    (self.bar.write if self.bar is not None else print)(text)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def plot_losses(history: dict, path: pathlib.Path, title: str) -> None:
  import matplotlib  # noqa: PLC0415

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(*zip(*history["train"]), label="train", lw=1)
  if history["eval"]:
    ax.plot(*zip(*history["eval"]), "o-", label="eval")
  ax.axhline(history["unigram_entropy_nats"], ls="--", c="gray", label="corpus unigram entropy")
  ax.set(xlabel="step", ylabel="cross entropy (nats / byte)", title=title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def train(config: ModelConfig, *, backend: str = "auto", out_dir: pathlib.Path, ckpt_dir: pathlib.Path | None = None,
          resume: bool = False, ckpt_every: int | None = None, seed: int = 0, quiet: bool = False) -> dict:
  """Trains ``config`` to ``config.steps``; returns the summary written to out_dir/summary.json."""
  train_tokens, eval_tokens = data.train_eval_split(data.load_documents())
  entropy = data.unigram_entropy(train_tokens)
  trainer = Trainer(config, backend=backend, seed=seed)
  train_batches = data.Batches(train_tokens, config.batch_size, config.seq_len, seed)
  eval_batches = data.Batches(eval_tokens, config.batch_size, min(config.seq_len, len(eval_tokens) - 2),
                              seed).fixed(config.eval_batches)
  state = trainer.init_state()
  manager = checkpoint_manager(ckpt_dir) if ckpt_dir is not None else None
  if resume:
    if manager is None:
      raise ValueError("--resume needs --ckpt-dir")
    state = restore_checkpoint(manager, state)
  start = int(state.step)
  log = (lambda *a: None) if quiet else print
  log(f"config {config.name}: {trainer.num_params / 1e6:.2f}M params, backend {backend} "
      f"(moe_ffn runs {resolve_backend(backend)}), {len(trainer.devices)} device(s) {jax.devices()[0].platform}, "
      f"expert parallel: {trainer.expert_parallel}, start step {start}")
  log(f"corpus: {len(train_tokens)} train / {len(eval_tokens)} eval bytes; unigram entropy "
      f"{entropy:.3f} nats/byte ({data.nats_to_bits(entropy):.3f} bits/byte)")
  history = {"train": [], "eval": [], "unigram_entropy_nats": entropy}
  progress = Progress(config.steps, start) if not quiet else None
  tokens_per_step = config.batch_size * config.seq_len
  timed_tokens, timed_seconds = 0, 0.0
  for step in range(start, config.steps):
    batch = trainer.place_batch(train_batches.at(step))
    began = time.perf_counter()
    state, metrics = trainer.train_step(state, batch)
    loss = float(metrics["loss"])  # waits for the step
    if step > start:  # the first step compiles
      timed_seconds += time.perf_counter() - began
      timed_tokens += tokens_per_step
    history["train"].append((step + 1, loss))
    tokens_per_s = timed_tokens / timed_seconds if timed_seconds else 0.0
    if progress:
      progress.update(step + 1, f"loss {loss:.3f} lb {float(metrics['load_balancing_loss']):.3f} "
                                f"tok/s {tokens_per_s:,.0f}")
    if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
      eval_loss = trainer.evaluate(state, eval_batches)
      history["eval"].append((step + 1, eval_loss))
      if progress:
        progress.write(f"step {step + 1}: eval loss {eval_loss:.4f} nats/byte")
    if manager is not None and ckpt_every and (step + 1) % ckpt_every == 0:
      save_checkpoint(manager, state)
  if progress:
    progress.close()
  if manager is not None and int(state.step) > start:
    save_checkpoint(manager, state)
  final_eval = history["eval"][-1][1] if history["eval"] else trainer.evaluate(state, eval_batches)
  summary = {"config": config.name, "backend": backend, "moe_backend": resolve_backend(backend),
             "devices": len(trainer.devices), "steps": int(state.step), "params": trainer.num_params,
             "final_train_loss": history["train"][-1][1] if history["train"] else None,
             "final_eval_loss": final_eval, "unigram_entropy_nats": entropy,
             "unigram_entropy_bits": data.nats_to_bits(entropy),
             "final_eval_bits_per_byte": data.nats_to_bits(final_eval), "tokens_per_s": tokens_per_s_of(
                 timed_tokens, timed_seconds), "history": history}
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
  if history["train"]:
    plot_losses(history, out_dir / "loss.png", f"{config.name}, backend {backend}")
  log(f"final eval loss {final_eval:.4f} nats/byte ({data.nats_to_bits(final_eval):.3f} bits/byte) vs unigram "
      f"entropy {entropy:.4f} nats/byte ({data.nats_to_bits(entropy):.3f} bits/byte); "
      f"{summary['tokens_per_s']:,.0f} tokens/s; curve {out_dir / 'loss.png'}")
  return summary


def tokens_per_s_of(tokens: int, seconds: float) -> float:
  return tokens / seconds if seconds else math.nan


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
  parser.add_argument("--backend", default="auto", choices=BACKENDS)
  parser.add_argument("--steps", type=int, help="override config.steps")
  parser.add_argument("--batch-size", type=int, help="override config.batch_size (global sequences per step)")
  parser.add_argument("--seq-len", type=int, help="override config.seq_len")
  parser.add_argument("--learning-rate", type=float, help="override config.learning_rate")
  parser.add_argument("--ckpt-dir", type=pathlib.Path, help="orbax checkpoint directory (saved at the end)")
  parser.add_argument("--ckpt-every", type=int, help="also save every N steps")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
  parser.add_argument("--out-dir", type=pathlib.Path, help="summary.json and loss.png (default runs/CONFIG)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  overrides = {name: value for name, value in (("steps", args.steps), ("batch_size", args.batch_size),
                                               ("seq_len", args.seq_len), ("learning_rate", args.learning_rate))
               if value is not None}
  if "steps" in overrides:
    base = CONFIGS[args.config]
    overrides.setdefault("warmup_steps", min(base.warmup_steps, max(0, overrides["steps"] // 10)))
  try:
    config = get_config(args.config, **overrides)
  except ValueError as error:
    parser.error(str(error))
  out_dir = args.out_dir or pathlib.Path(__file__).resolve().parent.parent / "runs" / config.name
  began = time.perf_counter()
  train(config, backend=args.backend, out_dir=out_dir, ckpt_dir=args.ckpt_dir, resume=args.resume,
        ckpt_every=args.ckpt_every, seed=args.seed)
  print(f"training took {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
  main()
