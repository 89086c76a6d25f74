"""Say what does not fit where, and what would."""

from __future__ import annotations

from costmodel.tables import CostTables

GIB = float(1 << 30)


def nothing_fits(tables: CostTables, stages: int | None) -> str:
    parts = []
    for t in tables.classes:
        parts.append(f"{t.name} ({t.device_type}): {t.model_bytes / GIB:.1f} GiB usable per device")
    state = max(t.held_state_bytes([range(len(t.state_bytes))]) for t in tables.classes)
    largest_block = max(max(t.state_bytes) for t in tables.classes)
    depth = f" with {stages} stages" if stages else ""
    return (f"the model fits on no device{depth}: training state {state / GIB:.1f} GiB in all, "
            f"largest block {largest_block / GIB:.2f} GiB; " + "; ".join(parts))


def what_would_fit(tables: CostTables) -> str:
    largest_block = max(max(t.state_bytes) for t in tables.classes)
    best = max(t.model_bytes for t in tables.classes)
    if largest_block > best:
        return (f"one block alone needs {largest_block / GIB:.2f} GiB but the largest device offers "
                f"{best / GIB:.2f} GiB: use devices with more memory")
    state = max(t.held_state_bytes([range(len(t.state_bytes))]) for t in tables.classes)
    return (f"spread the model over at least {int(state // best) + 1} pipeline stages (more devices "
            "or --stages), lower --memory-margin, or use devices with more memory")
