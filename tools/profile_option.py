"""`--profile FILE` (tools/flags.py add_profile_arg) for `simulate`, `search` and `run`: price on a measured
profile's hardware.

    from hybridflow.tools.profile_option import plan_with_profile, request_with_profile
    plan, cm = plan_with_profile(plan, args.profile)        # simulate: simulate(plan, cm)
    req, cm = request_with_profile(req, args.profile)       # search:   Planner(req, cm)

Both return (input, None) when no profile was given, so the calls can stay unconditional. The
plan / request is moved onto the profile's devices (its fitted figures and memory), keeping its
nodes × devices per node; the cost model is the calibrated one (simulator/calibration/fit.py). Where
Megatron roles are priced on a profile without the Megatron engine's points, a note on stderr says so.
"""

from __future__ import annotations

import sys


def megatron_note(cal, megatron_roles: bool) -> str | None:
    """The note for Megatron roles priced on a profile that lacks the Megatron engine's points."""
    if not megatron_roles or cal.overheads.megatron_fitted:
        return None
    return (f"note: profile '{cal.profile}' has no megatron_train / megatron_forward points: roles with "
            "train.backend megatron are priced by the analytic terms on its fitted hardware, without the "
            "Megatron engine's overheads (add them: hflow-plan profile --add-megatron FILE.json)")


def _say(note: str | None) -> None:
    if note:
        print(note, file=sys.stderr)


def plan_with_profile(plan, ref: str | None):
    if not ref:
        return plan, None
    from hybridflow.simulator.calibration.fit import plan_on_profile

    moved, cm, cal = plan_on_profile(plan, ref)
    _say(megatron_note(cal, any(rp.train.backend == "megatron" for rp in plan.roles.values())))
    return moved, cm


def request_with_profile(req, ref: str | None):
    if not ref:
        return req, None
    from hybridflow.simulator.calibration.fit import calibrate_file

    cal = calibrate_file(ref)
    _say(megatron_note(cal, "megatron" in req.backends))
    cluster = cal.cluster(req.cluster)
    return req.model_copy(update={"cluster": cluster}), cal.cost_model(cluster)


def local_pricing(devices: int | None = None, profile: str = "cpu-2core", *, reprobe: bool = False,
                  notes: list[str] | None = None):
    """(this machine as a one-node ClusterSpec, a cost model for it, the profile it came from or
    None) — for `quickstart`.

    When the shipped `profile` was measured on this kind of machine (same CPU / GPU model and core
    count), the cluster and cost model are its calibration's; otherwise the hardware probe's
    figures (measured in seconds, cached; measured again with `reprobe`, when stale or when a quick check
    disagrees: runtime/measure/hardware_probe.py) with the analytic default terms; `notes` gets what the probe
    says (measured again, or taken on a busy machine)."""
    from hybridflow.runtime.measure.hardware_probe import default_devices, fingerprint, local_cluster
    from hybridflow.simulator.calibration.fit import calibrate_file
    from hybridflow.simulator.calibration.profile import resolve_profile
    from hybridflow.simulator.errors import HflowError
    from hybridflow.simulator.vocabulary.hardware import ClusterSpec

    world = devices or default_devices()
    try:
        shipped = resolve_profile(profile)
    except HflowError:
        shipped = None
    if shipped is not None and shipped.fingerprint.same_machine(fingerprint(world)):
        cal = calibrate_file(profile)
        cluster = ClusterSpec(hardware=cal.hardware, nodes=1, devices_per_node=world)
        return cluster, cal.cost_model(cluster), profile
    from hybridflow.simulator.calibration.gpu_fit import default_cost_model

    cluster = local_cluster(world, refresh=reprobe, notes=notes)
    return cluster, default_cost_model(cluster), None
