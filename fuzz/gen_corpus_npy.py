#!/usr/bin/env python3
"""Writes the seed corpus of fuzz/fuzz_npy.cpp into fuzz/corpus/npy/ (Python standard library only).

Valid files of each accepted dtype and rank 0..4, the three format versions, header variations
numpy accepts, and a few broken files. Run from the repository root: python3 fuzz/gen_corpus_npy.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "npy")


def npy(dict_text, data, major=1, align=64, newline=True):
    header = dict_text.encode("ascii")
    pre = 10 if major == 1 else 12
    pad = (-(pre + len(header) + 1)) % align
    header += b" " * pad + (b"\n" if newline else b" ")
    length = struct.pack("<H", len(header)) if major == 1 else struct.pack("<I", len(header))
    return b"\x93NUMPY" + bytes([major, 0]) + length + header + data


def header(descr, shape, fortran="False"):
    dims = "".join(f"{d}, " for d in shape) if len(shape) != 1 else f"{shape[0]},"
    return "{'descr': '%s', 'fortran_order': %s, 'shape': (%s), }" % (descr, fortran, dims.rstrip(", ") if len(shape) > 1 else dims)


def data(descr, count):
    if descr == "<f4":
        return struct.pack(f"<{count}f", *[i * 0.5 - 1 for i in range(count)])
    if descr == "<f2":
        return struct.pack(f"<{count}e", *[i * 0.25 for i in range(count)])
    return struct.pack(f"<{count}i", *[i - 3 for i in range(count)])


def main():
    os.makedirs(OUT, exist_ok=True)
    files = {}
    shapes = [(), (0,), (3,), (2, 3), (2, 0, 4), (2, 2, 3), (1, 2, 1, 3)]
    for descr, tag in (("<f4", "f4"), ("<f2", "f2"), ("<i4", "i4")):
        for shape in shapes:
            count = 1
            for d in shape:
                count *= d
            name = f"valid_{tag}_rank{len(shape)}_{'x'.join(map(str, shape)) or 'scalar'}.npy"
            files[name] = npy(header(descr, shape), data(descr, count))
    files["valid_v2.npy"] = npy(header("<f4", (2, 2)), data("<f4", 4), major=2)
    files["valid_v3.npy"] = npy(header("<i4", (3,)), data("<i4", 3), major=3)
    files["valid_align16_doublequotes.npy"] = npy('{"descr": "<f4", "shape": (2, 1), "fortran_order": False}',
                                                  data("<f4", 2), align=16)
    # broken ones
    files["bad_magic.npy"] = b"\x93NUMPZ" + files["valid_f4_rank2_2x3.npy"][6:]
    files["bad_version.npy"] = files["valid_f4_rank1_3.npy"][:6] + b"\x04\x00" + files["valid_f4_rank1_3.npy"][8:]
    files["bad_header_len.npy"] = files["valid_f4_rank1_3.npy"][:8] + b"\xff\xff" + files["valid_f4_rank1_3.npy"][10:]
    files["bad_truncated.npy"] = files["valid_f4_rank3_2x2x3.npy"][:-5]
    files["bad_trailing.npy"] = files["valid_i4_rank2_2x3.npy"] + b"\x00\x01"
    files["bad_big_endian.npy"] = npy(header(">f4", (2,)), b"\x00" * 8)
    files["bad_fortran.npy"] = npy(header("<f4", (2, 2), fortran="True"), data("<f4", 4))
    files["bad_negative.npy"] = npy(header("<f4", (2, -1)), b"")
    files["bad_overflow.npy"] = npy(header("<f4", (4611686018427387904, 4)), b"")
    files["bad_no_shape.npy"] = npy("{'descr': '<f4', 'fortran_order': False, }", b"")
    files["bad_unterminated.npy"] = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1,)", data("<f4", 1))
    files["bad_no_newline.npy"] = npy(header("<f4", (1,)), data("<f4", 1), newline=False)
    files["bad_int_shape.npy"] = npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3)}", data("<f4", 3))
    for name, content in sorted(files.items()):
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(content)
    print(f"wrote {len(files)} files to {OUT}")


if __name__ == "__main__":
    main()
