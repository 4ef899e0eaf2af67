"""The memory order the last-arriver kernels rely on, read from their PTX (tests/gpu_compile.py checks every compiled
kernel that counts its finished programs). Importable without a GPU compiler."""

from __future__ import annotations

ACQ_REL_ATOM = "atom.global.gpu.acq_rel"


def last_arriver_order_problem(ptx: str) -> str:
    """The order a kernel that counts its finished programs relies on (paged attention's folded splits, the fused
    router), checked in its PTX: each program's global stores, then a CTA barrier, then the one-thread acq_rel
    count (release); after the count a barrier (the count's broadcast) before the last program's L2 reads of the
    others' stores (ld.global.cg), none of which may come before the first count. "" when it holds."""
    lines = [line.strip() for line in ptx.splitlines()]
    atoms = [i for i, line in enumerate(lines) if ACQ_REL_ATOM in line]
    l2_reads = [i for i, line in enumerate(lines) if "ld.global.cg" in line]
    if l2_reads and l2_reads[0] < atoms[0]:
        return f"an L2 read of the partials (PTX line {l2_reads[0]}) before the first count (line {atoms[0]})"
    for atom in atoms:
        before = [line for line in lines[:atom] if line.startswith(("bar.sync", "st.global", "@"))
                  and ("bar.sync" in line or "st.global" in line)]
        if not before or "bar.sync" not in before[-1]:
            return f"the count at PTX line {atom} is not preceded by a barrier after the last store"
        next_read = next((i for i in l2_reads if i > atom), None)
        if next_read is not None and not any("bar.sync" in line for line in lines[atom:next_read]):
            return f"no barrier between the count at PTX line {atom} and the L2 read at line {next_read}"
    return ""
