"""``tools/sass_loop.py``: the loop it picks from a disassembly and the instructions it counts, on SASS text
laid out as ``cuobjdump -sass`` prints it (the tool itself needs CUDA's cuobjdump, which CI lacks)."""

from __future__ import annotations

import pytest

from tools.sass_loop import gemv_weights_per_step, main_loops

SASS = """
        Function : gemv_int4_f16_r1
        /*0000*/                   MOV R1, c[0x0][0x28] ;                 /* 0x00000a0000017a02 */
        /*0010*/               @P0 BRA 0x60 ;                             /* 0x0000004000000947 */
        /*0020*/                   LDG.E.128.CONSTANT R4, [R2.64] ;       /* 0x0000000802047981 */
        /*0030*/                   FFMA R8, R4, R5, R8 ;                  /* 0x0000000504087223 */
        /*0040*/              @!P1 BRA 0x20 ;                             /* 0xffffffd000009947 */
        /*0050*/                   NOP ;                                  /* 0x0000000000007918 */
        /*0060*/                   LDG.E.128.CONSTANT R4, [R2.64] ;       /* 0x0000000802047981 */
        /*0070*/                   LDG.E.128.CONSTANT R12, [R2.64+0x200] ; /* 0x0000200802047981 */
        /*0080*/                   PRMT R9, R4, 0x4440, RZ ;              /* 0x0000444004097816 */
        /*0090*/                   FFMA R8, R9, R5, R8 ;                  /* 0x0000000509087223 */
        /*00a0*/               @P2 FFMA R10, R9, R6, R10 ;                /* 0x0000000609087223 */
        /*00b0*/                   BRA 0x60 ;                             /* 0xffffffa000007947 */
        /*00c0*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_the_main_loop_is_the_one_with_the_most_vector_loads_and_its_opcodes_are_counted():
    (loop,) = main_loops(SASS)
    assert len(loop.instructions) == 6 and loop.vector_loads == 2  # 0x60 .. its backward branch at 0xb0
    assert loop.opcodes() == {"LDG": 2, "PRMT": 1, "FFMA": 2, "BRA": 1}  # predicates and modifiers dropped


TWO_LOOPS_SASS = """
        Function : two_loops
        /*0000*/                   LDG.E.128.CONSTANT R4, [R2.64] ;       /* 0x0000000802047981 */
        /*0010*/                   FFMA R8, R4, R5, R8 ;                  /* 0x0000000504087223 */
        /*0020*/              @!P1 BRA 0x0 ;                              /* 0xffffffd000009947 */
        /*0030*/                   ATOMG.E.ADD R0, [R6.64], R0 ;          /* 0x0000000806007981 */
        /*0040*/                   LDG.E.128.STRONG.GPU R4, [R2.64] ;     /* 0x0000000802047981 */
        /*0050*/                   FFMA R8, R4, R5, R8 ;                  /* 0x0000000504087223 */
        /*0060*/                   FFMA R9, R4, R6, R9 ;                  /* 0x0000000504087223 */
        /*0070*/              @!P1 BRA 0x40 ;                             /* 0xffffffd000009947 */
        /*0080*/              @!P2 BRA 0x0 ;                              /* 0xffffffd000009947 */
        /*0090*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_two_loops_of_as_many_loads_are_both_main_and_a_branch_around_them_is_not():
    """A kernel with two loops of as many vector loads, and a backward branch whose body holds both."""
    loops = main_loops(TWO_LOOPS_SASS)
    assert [(loop.start, loop.end, len(loop.instructions)) for loop in loops] == [(0x0, 0x20, 3), (0x40, 0x70, 4)]
    assert [loop.vector_loads for loop in loops] == [1, 1]


def test_a_disassembly_without_a_loop_is_refused():
    with pytest.raises(ValueError, match="no loop"):
        main_loops(SASS.replace("BRA 0x20", "BRA 0x50").replace("BRA 0x60", "BRA 0xc0"))


def test_weights_a_gemv_loop_step_reads():
    assert gemv_weights_per_step("gemv_int4_f16_r1") == 256  # 8 vectors of 32 int4 weights
    assert gemv_weights_per_step("gemv_int8_swiglu_bf16_r8") == 128
    assert gemv_weights_per_step("gemv_float_f16_r2") == 64 and gemv_weights_per_step("gemv_float_f32_r1") == 32
    assert gemv_weights_per_step("paged_decode_attention_f16_d128_g2") is None
