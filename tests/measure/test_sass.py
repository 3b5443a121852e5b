"""measure/sass.py's reading of a loop body's loads, on SASS text written out here (no compiler)."""

from localpd.measure.sass import in_trip_loads, local_in_loops, loop_body


def test_a_load_read_in_its_own_trip_is_waited_on_and_one_read_next_trip_is_not():
    body = ["LDG.E.128 R4, desc[UR4][R2.64]",  # read below: waited on
            "LDG.E.U16 R9, desc[UR4][R10.64]",  # issued before the first wait: the same round trip
            "HFMA2 R12, R5, R6, R12",
            "FMUL R13, R9, R13",
            "LDG.E R20, desc[UR4][R14.64]",  # issued after the trip waited: a second round trip
            "IADD3 R21, R20, 0x1, RZ",
            "LDG.E R30, desc[UR4][R16.64]",  # only the next trip reads it: loaded ahead
            "LDG.E R31, desc[UR4][R18.64]",  # written again before any read: not waited on here
            "MOV R31, R4",
            "LDGSTS.E.BYPASS.128 [R40+0x800], desc[UR4][R22.64]",  # the pipeliner's copy: no register result
            "STS [R41], R30",  # ... unless this store reads it: a wait after all, and a third round trip
            "BRA 0x100"]
    assert in_trip_loads(body) == (4, 3)
    assert in_trip_loads(body[:10] + body[11:]) == (3, 2)
    assert in_trip_loads(body, cover=4) == (4, 2)  # R30, read 4 instructions after its issue, waits no more
    assert in_trip_loads(body, cover=2) == (4, 1)  # only R20, read the instruction after its load, still waits


def test_a_pair_of_registers_read_as_one_operand_counts_as_a_read():
    body = ["LDG.E.64 R6, desc[UR4][R2.64]", "IMAD.WIDE R8, R1, 0x4, R6.64", "BRA 0x0"]
    assert in_trip_loads(body) == (1, 1)
    assert in_trip_loads(["LDG.E.64 R6, desc[UR4][R2.64]", "IADD3 R8, R7, 0x1, RZ", "BRA 0x0"]) == (1, 1)
    # a matrix instruction's fragment named by its first register reads the 4 from it: R14 of R12's
    mma = ["LDG.E R14, desc[UR4][R2.64]", "HMMA.16816.F32 R20, R12, R16, R20", "BRA 0x0"]
    assert in_trip_loads(mma) == (1, 1)
    assert in_trip_loads([mma[0], "FADD R20, R12, R16", "BRA 0x0"]) == (0, 0)
    # ... its B fragment 2 (m16 n8 k16 of 16-bit inputs): R18 is not R16's, and an m16 n8 k8 B fragment is 1
    assert in_trip_loads(["LDG.E R18, desc[UR4][R2.64]", mma[1], "BRA 0x0"]) == (0, 0)
    assert in_trip_loads(["LDG.E R17, desc[UR4][R2.64]", mma[1], "BRA 0x0"]) == (1, 1)
    assert in_trip_loads(["LDG.E R17, desc[UR4][R2.64]", "HMMA.1688.F32 R20, R12, R16, R20", "BRA 0x0"]) == (0, 0)
    imma = "IMMA.16832.S8.S8.SAT R20, R12, R16, R20"
    assert in_trip_loads(["LDG.E R17, desc[UR4][R2.64]", imma, "BRA 0x0"]) == (1, 1)
    assert in_trip_loads(["LDG.E R13, desc[UR4][R2.64]", "IMMA.8816.S32.S8.S8 R20, R12, R16, R20", "BRA 0x0"]) == (0, 0)


def test_the_loop_body_is_the_largest_backward_branchs():
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/              @P0  FADD R3, R2, R3 ;
        /*0030*/              @!P0 BRA 0x10 ;
        /*0040*/                   EXIT ;
    """
    assert loop_body(sass) == ["LDG.E R2, desc[UR4][R4.64]", "FADD R3, R2, R3", "BRA 0x10"]


def test_only_local_accesses_inside_a_loop_count_as_reloaded_every_trip():
    sass = """
        /*0000*/                   STL [R1], R14 ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/              @P1  LDL R3, [R1+0x4] ;
        /*0030*/                   STL [R1+0x4], R3 ;
        /*0040*/              @!P0 BRA 0x10 ;
        /*0050*/                   LDL.LU R33, [R1] ;
        /*0060*/                   EXIT ;
    """
    assert local_in_loops(sass) == 2  # the loop's reload and store; not the store before it or the load after
    assert local_in_loops(sass.replace("@!P0 BRA 0x10", "@!P0 BRA 0x40")) == 0
