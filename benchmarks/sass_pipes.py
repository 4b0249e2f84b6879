"""Count a SASS listing's instructions by the pipe that executes them, over address ranges.

Usage: python benchmarks/sass_pipes.py DUMP/routing.sass 0b60:1790 30d0:37d0 ...
(ranges ``START:END`` in hex, END excluded, as printed in the listing; ``inspect_kernel.py --dump DUMP``
writes the listing). Pipes follow Nsight Compute's naming: ``alu`` (integer and float compare,
min/max, select, logic, shifts, LEA, IADD3: 16 lanes per scheduler, so 2 cycles per warp
instruction), ``fma`` (FADD/FMUL/FFMA and every IMAD form), ``xu`` (MUFU), ``uniform`` (U*
instructions, the scalar datapath), and the rest by opcode. Every instruction, whatever its pipe,
takes one of its scheduler's issue slots (one per cycle).
"""

import collections
import re
import sys

ALU = {"SEL", "ISETP", "FMNMX", "LOP3", "SHF", "VIMNMX", "VIMNMX3", "FSETP", "FSEL", "LEA", "IADD3", "VIADD", "IABS",
       "PRMT", "POPC", "FLO", "IMNMX", "PLOP3", "P2R", "R2P", "BMSK", "BREV", "SGXT"}
FMA = {"IMAD", "FMUL", "FFMA", "FADD", "HFMA2", "IMUL"}
OP = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def pipe(op: str) -> str:
    if op in ALU:
        return "alu"
    if op in FMA:
        return "fma"
    if op == "MUFU":
        return "xu"
    if op.startswith("U") and op != "UMOV":
        return "uniform"
    return op.lower()


def main() -> None:
    listing = open(sys.argv[1]).read().splitlines()
    ops = [(int(m.group(1), 16), m.group(2)) for m in map(OP.match, listing) if m]
    total = collections.Counter()
    for spec in sys.argv[2:]:
        start, end = (int(x, 16) for x in spec.split(":"))
        counts = collections.Counter(pipe(op) for addr, op in ops if start <= addr < end and op != "NOP")
        total += counts
        print(f"{spec}: {sum(counts.values())} instructions", dict(counts.most_common()))
    print(f"all ranges: {sum(total.values())} instructions", dict(total.most_common()))


if __name__ == "__main__":
    main()
