"""One model across several hosts, with JAX's own multi-controller runtime (grok-1's between-hosts mesh).

Every host runs this same program on its local devices; `jax.distributed.initialize` joins them and
the ("data", "model") mesh spans all hosts: `--mesh` tiles each host's devices, `--hosts-mesh` tiles
the hosts. Host 0 serves HTTP and owns the schedule; the others have no HTTP and no scheduler: they
replay, in the same order, every engine call host 0 makes (`LeaderEngine` broadcasts each call over
the control channel before issuing it, `follow` replays them). The engine's calls are the only
programs with collectives, so identical call sequences are all it takes for the hosts to agree —
there is no Python control flow on the followers that could diverge.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import sys

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from hkserve.engine.block_pool import PoolExhausted
from hkserve.engine.forwarding import ForwardsQueries
from hkserve.engine.prefill_job import OneShotPrefill
from hkserve.engine.prefix_cache import Reuse
from hkserve.engine.state import ContextLengthError
from hkserve.model.sampling import SamplingParams
from hkserve.model.sharding import parse_mesh
from hkserve.multihost.control import Follower, Leader, load_secret

log = logging.getLogger("hkserve.multihost")


@dataclasses.dataclass(frozen=True)
class HostFlags:
    """The multi-host flags as given (None: not given; HostGroup.from_flags then reads the environment)."""

    coordinator: str | None = None  # --coordinator HOST:PORT
    num_hosts: int | None = None  # --num-hosts
    host_id: int | None = None  # --host-id
    hosts_mesh: str | None = None  # --hosts-mesh DATAxMODEL


@dataclasses.dataclass(frozen=True)
class HostGroup:
    """Where this process sits among the hosts of one server."""

    coordinator: str  # HOST:PORT of host 0's jax.distributed coordinator
    num_hosts: int
    host_id: int
    hosts_mesh: str  # DATAxMODEL: how the hosts tile the mesh axes
    control_port: int  # host 0's control channel (default: coordinator port + 1)
    control_bind: str  # the interface host 0's control port listens on (default: the coordinator's host)
    secret: bytes = dataclasses.field(repr=False, default=b"")  # shared by all hosts (control.load_secret)

    @property
    def leader_host(self) -> str:
        return self.coordinator.rsplit(":", 1)[0]

    @classmethod
    def from_flags(cls, flags: HostFlags) -> HostGroup | None:
        """Flags, else HKSERVE_COORDINATOR / HKSERVE_NUM_HOSTS / HKSERVE_HOST_ID / HKSERVE_HOSTS_MESH /
        HKSERVE_CONTROL_PORT / HKSERVE_CONTROL_BIND, and the shared secret (control.load_secret). None when
        this is a single-host server."""
        env = os.environ.get
        coordinator = flags.coordinator or env("HKSERVE_COORDINATOR")
        num_hosts = int(flags.num_hosts or env("HKSERVE_NUM_HOSTS") or 1)
        if coordinator is None and num_hosts == 1:
            return None
        host_id = int(flags.host_id if flags.host_id is not None else env("HKSERVE_HOST_ID", "-1"))
        if coordinator is None or ":" not in coordinator:
            raise ValueError(f"--coordinator must be HOST:PORT of host 0, got {coordinator!r}")
        if num_hosts < 1 or not 0 <= host_id < num_hosts:
            raise ValueError(f"--host-id must be in 0..{num_hosts - 1} (--num-hosts {num_hosts}), got {host_id}")
        port = int(coordinator.rsplit(":", 1)[1])
        hosts_mesh = flags.hosts_mesh or env("HKSERVE_HOSTS_MESH") or f"{num_hosts}x1"
        control = int(env("HKSERVE_CONTROL_PORT") or port + 1)
        bind = env("HKSERVE_CONTROL_BIND") or coordinator.rsplit(":", 1)[0]
        group = cls(coordinator, num_hosts, host_id, hosts_mesh, control, bind, load_secret())
        d, m = group.hosts_shape
        if d * m != num_hosts:
            raise ValueError(f"--hosts-mesh {hosts_mesh} needs {d * m} hosts, --num-hosts is {num_hosts}")
        return group

    @property
    def hosts_shape(self) -> tuple[int, int]:
        try:
            d, m = (int(x) for x in self.hosts_mesh.lower().split("x"))
        except ValueError:
            raise ValueError(f"--hosts-mesh must look like DATAxMODEL (e.g. 2x1), got {self.hosts_mesh!r}") from None
        return d, m

    def initialize(self) -> None:
        """Join the other hosts. CPU collectives go through gloo (GPUs use NCCL on their own)."""
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(self.coordinator, num_processes=self.num_hosts, process_id=self.host_id)
        log.info(
            "host %d of %d joined %s: %d local / %d global devices",
            self.host_id,
            self.num_hosts,
            self.coordinator,
            jax.local_device_count(),
            jax.device_count(),
        )

    def mesh(self, local: str | None, config=None):
        """The global ("data", "model") mesh: each host's devices tiled by `local` (default: as
        `parse_mesh` would on one host), hosts tiled by `hosts_mesh`; a device's host is its process."""
        local_mesh = parse_mesh(local, config, devices=jax.local_devices())
        shape = (local_mesh.shape["data"], local_mesh.shape["model"])
        devices = mesh_utils.create_hybrid_device_mesh(
            shape, self.hosts_shape, devices=jax.devices(), process_is_granule=True
        )
        return Mesh(devices, ("data", "model"))


def _call(op: str, **args) -> dict:
    return {"op": op, **args}


class LeaderEngine(OneShotPrefill, ForwardsQueries):
    """Host 0's engine: the Engine's interface, each device call first sent to the followers.

    Calls are broadcast before they are issued locally, since a multi-host program cannot finish
    until every host has issued it. Errors raised before any device work (a prompt too long, a bad
    logit_bias) are raised identically by the followers' replay, which skips them."""

    def __init__(self, engine, leader: Leader):
        self.inner, self._leader = engine, leader

    # -- host-side queries and capabilities: host 0's engine answers alone (ServingEngine) ----------
    @property
    def supports_grammars(self) -> bool:
        return self.inner.supports_grammars

    def rows_program(self, prompt_len: int) -> tuple[int, int] | None:
        return self.inner.rows_program(prompt_len)

    def spec_counts(self):
        return self.inner.spec_counts()

    def prefill(
        self, slot: int, prompt_ids, settings: SamplingParams | None = None, reuse=None, bitmask=None, generated=0
    ):
        """With `reuse`: host 0's prefix cache chose it (a slot's rows or the pool's cached blocks), the
        followers reuse the same; with `bitmask`: a grammar's first mask; with `generated`: a preempted
        request resuming (paged layout)."""
        # The pool's cached blocks travel too: a follower's pool holds the same blocks (it replays every
        # call that changes one), and without them it would read the reuse as a copy from the slot.
        extra = {"reuse": [int(reuse.source), int(reuse.length), [int(b) for b in reuse.blocks]]} if reuse else {}
        extra |= {"generated": int(generated)} if generated else {}
        settings = self._announce("prefill", slot, prompt_ids, settings, bitmask, **extra)
        return self.inner.prefill(slot, prompt_ids, settings, **_keywords(reuse, bitmask), **_generated(generated))

    def release(self, slot: int, keep: bool = False, written=()) -> None:
        """Paged: a slot's blocks go back to the pool on every host, so that the followers' block pools
        (replaying the same prefills, steps and releases in order) make host 0's decisions: the same
        block tables, the same blocks shared and freed. The static layout holds nothing to release."""
        if self.inner.kv_pool is not None:
            ids = [int(t) for t in written]  # the reply's blocks registered alike on every host
            self._leader.broadcast(_call("release", slot=int(slot), keep=bool(keep), written=ids))
        self.inner.release(slot, keep, written)

    def score_prefill(self, slot: int, prompt_ids, settings: SamplingParams | None = None, bitmask=None):
        settings = self._announce("score_prefill", slot, prompt_ids, settings, bitmask)
        return self.inner.score_prefill(slot, prompt_ids, settings, **_keywords(bitmask=bitmask))

    def _announce(self, op: str, slot: int, prompt_ids, settings: SamplingParams | None, bitmask, **extra):
        """Send a prefill call to the followers; returns the settings it carries."""
        settings = settings or SamplingParams()
        ids = [int(t) for t in prompt_ids]
        mask = None if bitmask is None else _pack_mask(bitmask)
        message = _call(op, slot=int(slot), ids=ids, settings=dataclasses.asdict(settings), mask=mask, **extra)
        self._leader.broadcast(message)
        return settings

    def prefill_many(self, slots, prompts, settings):
        settings = [s or SamplingParams() for s in settings]
        ids = [[int(t) for t in p] for p in prompts]
        sets = [dataclasses.asdict(s) for s in settings]
        self._leader.broadcast(_call("prefill_many", slots=[int(s) for s in slots], ids=ids, settings=sets))
        return self.inner.prefill_many(slots, prompts, settings)

    def step(self, active):
        active = np.asarray(active, bool)
        self._leader.broadcast(_call("step", active=active.tolist()))
        return self.inner.step(active)

    def step_forward(self, active):
        active = np.asarray(active, bool)
        self._leader.broadcast(_call("step_forward", active=active.tolist()))
        return self.inner.step_forward(active)

    def step_sample(self, forward, bitmask):
        self._leader.broadcast(_call("step_sample", mask=_pack_mask(bitmask)))
        return self.inner.step_sample(forward, bitmask)

    def reset(self) -> None:
        self._leader.broadcast(_call("reset"))
        self.inner.reset()

    def warmup(self, upto: int | None = None) -> None:
        """Every program, on every host, before ready: a follower compiles only when host 0's call reaches
        it, so a cut would make it compile inside a collective host 0 already entered
        (background_compile.py)."""
        if upto is not None:
            raise ValueError("multi-host serving compiles every program before ready (--compile eager)")
        self._leader.broadcast(_call("warmup"))
        self.inner.warmup()

    def close(self) -> None:
        """Tell the followers to exit cleanly, then close the channel."""
        try:
            self._leader.broadcast(_call("exit"))
        except ConnectionError:
            pass
        self._leader.close()


def _pack_mask(bitmask) -> dict:
    """A grammar bitmask [B, W] int32 as JSON: its shape and its bytes in base64."""
    bitmask = np.ascontiguousarray(bitmask, np.int32)
    return {"shape": list(bitmask.shape), "data": base64.b64encode(bitmask.tobytes()).decode("ascii")}


def _unpack_mask(mask: dict | None):
    if mask is None:
        return None
    return np.frombuffer(base64.b64decode(mask["data"]), np.int32).reshape(mask["shape"])


def _keywords(reuse=None, bitmask=None) -> dict:
    """The reuse and bitmask keywords, only where given (an engine call without them is unchanged)."""
    return {k: v for k, v in (("reuse", reuse), ("bitmask", bitmask)) if v is not None}


def _generated(generated: int) -> dict:
    """The generated keyword, only where a request resumes (an engine call without it is unchanged)."""
    return {"generated": generated} if generated else {}


def follow(engine, follower: Follower) -> int:
    """Replay host 0's engine calls until it says exit (0). Host 0's loss ends the process from the
    channel's reader thread, since this thread may be inside a collective that never completes."""
    forward = []  # the step_forward awaiting its step_sample (grammar-constrained steps)

    def prefill(m, op):
        reuse = Reuse(m["reuse"][0], m["reuse"][1], tuple(m["reuse"][2])) if m.get("reuse") else None
        settings = SamplingParams(**m["settings"])
        keywords = _keywords(reuse, _unpack_mask(m.get("mask"))) | _generated(m.get("generated", 0))
        return op(m["slot"], m["ids"], settings, **keywords)

    calls = {
        "prefill": lambda m: prefill(m, engine.prefill),
        "score_prefill": lambda m: prefill(m, engine.score_prefill),
        "step_forward": lambda m: forward.append(engine.step_forward(np.asarray(m["active"], bool))),
        "step_sample": lambda m: engine.step_sample(forward.pop(), _unpack_mask(m["mask"])),
        "prefill_many": lambda m: engine.prefill_many(
            m["slots"], m["ids"], [SamplingParams(**s) for s in m["settings"]]
        ),
        "step": lambda m: engine.step(np.asarray(m["active"], bool)),
        "release": lambda m: engine.release(m["slot"], m["keep"], m.get("written", ())),
        "reset": lambda m: engine.reset(),
        "warmup": lambda m: engine.warmup(),
    }
    for message in follower:
        op = message.get("op")
        if op == "exit":
            log.info("host 0 stopped: exiting")
            return 0
        if op not in calls:
            raise RuntimeError(f"unknown control call {op!r} from host 0 (mismatched hkserve versions?)")
        try:
            calls[op](message)
        except (ValueError, ContextLengthError, PoolExhausted):
            pass  # host 0 got the same error before any device work, and told its client
    return 0


def exit_lost(who: str, reason: str) -> None:
    """Leave now, non-zero, naming the lost host: nothing can finish without it."""
    print(f"hkserve serve: error: lost {who} ({reason}); exiting", file=sys.stderr, flush=True)
    os._exit(3)
