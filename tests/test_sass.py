"""The wgmma register-race detector on recorded SASS.

The snippets are cut from cuobjdump listings of vLLM 0.26.0's
``_lora_expand_kernel`` compiled for sm_90 by Triton 3.7.1 (ptxas 12.8.93),
then varied one property at a time.
"""

from __future__ import annotations

from patchkit.cli.commands.doctor import hazard_json
from patchkit.doctor import sass

# block_n 128, 2 stages, fp32 input: the pipelined loop of the unpatched default.
PIPELINED = """
        /*4310*/                   DEPBAR.LE SB0, 0x0 ;
        /*44e0*/                   LDS.64 R90, [R140+UR33+0x4400] ;
        /*44f0*/                   LDS.64 R88, [R142+UR33+0x4400] ;
        /*4500*/                   LDS.64 R102, [R145+UR33+0x4000] ;
        /*4520*/                   F2FP.BF16.F32.PACK_AB R92, R93, R92 ;
        /*45e0*/                   WARPGROUP.ARRIVE ;
        /*45f0*/                   HGMMA.64x128x16.F32.BF16 R24, R92, gdesc[UR4], R24, gsb0 ;
        /*4630*/                   F2FP.BF16.F32.PACK_AB R88, R89, R88 ;
        /*4650*/                   F2FP.BF16.F32.PACK_AB R90, R103, R102 ;
        /*46d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*46e0*/                   WARPGROUP.ARRIVE ;
        /*46f0*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR4], R24, gsb0 ;
        /*4700*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*4860*/               @P2 BRA 0x4310 ;
        /*4870*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*4900*/                   F2FP.BF16.F32.PACK_AB R88, R25, R24 ;
"""


def hazard_addresses(listing: str) -> list[str]:
    return [sass.address(h.address) for h in sass.scan(listing).hazards]


def test_the_pipelined_loop_overwrites_the_in_flight_fragment_across_the_back_edge():
    findings = sass.scan(PIPELINED)
    assert findings.verdict == "hazard"
    assert findings.hgmma == 2 and findings.register_a == 2
    # the next iteration's loads and converts into R88-R91 while HGMMA 0x46f0 is in flight
    assert hazard_addresses(PIPELINED) == ["0x44e0", "0x44f0", "0x4630", "0x4650"]
    first = hazard_json(findings.hazards[0])
    assert first == {
        "address": "0x44e0",
        "instruction": "LDS.64 R90, [R140+UR33+0x4400]",
        "registers": ["R90", "R91"],
        "wgmma": "0x46f0",
    }


def test_without_the_back_edge_there_is_no_hazard():
    """The race needs the loop: the same body run once is clean."""
    straight = PIPELINED.replace("@P2 BRA 0x4310", "@P2 BRA 0x4870")
    assert hazard_addresses(straight) == []
    assert sass.scan(straight).verdict == "clean"


def test_a_wait_for_all_groups_inside_the_loop_clears_it():
    """num_stages 1: ptxas waits with DEPBAR.LE gsb0, 0x0 after each wgmma."""
    waited = PIPELINED.replace("WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x0")
    assert hazard_addresses(waited) == []


def test_the_depbar_count_decides_which_groups_are_retired():
    """LE 0x2 keeps two groups in flight: the fragment of 0x45f0 is then overwritten too."""
    looser = PIPELINED.replace("WARPGROUP.DEPBAR.LE gsb0, 0x1", "WARPGROUP.DEPBAR.LE gsb0, 0x2")
    addresses = hazard_addresses(looser)
    assert "0x4520" in addresses  # F2FP R92 while HGMMA 0x45f0 of the last iteration reads it


def test_a_write_after_the_covering_depbar_is_fine():
    """After the loop, DEPBAR.LE 0x0 retires everything; F2FP R88 at 0x4900 is no hazard."""
    assert "0x4900" not in hazard_addresses(PIPELINED)


def test_predicated_writes_count_and_never_executing_ones_do_not():
    predicated = PIPELINED.replace(
        "LDS.64 R90, [R140+UR33+0x4400]", "@P1 LDS.64 R90, [R140+UR33+0x4400]"
    )
    assert "0x44e0" in hazard_addresses(predicated)
    never = PIPELINED.replace("LDS.64 R90, [R140+UR33+0x4400]", "@!PT LDS.64 R90, [R140]")
    assert "0x44e0" not in hazard_addresses(never)


def test_destination_width_64_and_128_bits():
    """LDS.64 R86 writes R86-R87 (misses R88); LDS.128 R86 writes R86-R89 (hits R88-R89)."""
    narrow = PIPELINED.replace("LDS.64 R88, [R142+UR33+0x4400]", "LDS.64 R86, [R142]")
    assert "0x44f0" not in hazard_addresses(narrow)
    wide = PIPELINED.replace("LDS.64 R88, [R142+UR33+0x4400]", "LDS.128 R86, [R142]")
    hazard = next(h for h in sass.scan(wide).hazards if h.address == 0x44F0)
    assert hazard.registers == (88, 89)


def test_a_shared_memory_operand_has_no_register_fragment():
    """bf16 input: A comes from shared memory (a descriptor), nothing to overwrite."""
    smem = PIPELINED.replace("R24, R92, gdesc[UR4]", "R24, gdesc[UR8], gdesc[UR4]").replace(
        "R24, R88, gdesc[UR4]", "R24, gdesc[UR12], gdesc[UR4]"
    )
    findings = sass.scan(smem)
    assert findings.verdict == "no-register-operand" and findings.hgmma == 2
    assert findings.hazards == []


def test_wgmmas_without_gsb0_join_the_group_the_next_one_commits():
    """Two HGMMAs, the first without gsb0, form one group: one DEPBAR LE 0 retires both."""
    grouped = """
        /*7420*/                   LDS.64 R104, [R247+UR7] ;
        /*7ee0*/                   HGMMA.64x128x16.F32.BF16 R24, R104, gdesc[UR16], R24 ;
        /*7ef0*/                   LDS.64 R106, [R247+UR7] ;
        /*7f10*/                   HGMMA.64x128x16.F32.BF16 R24, R108, gdesc[UR12], R24, gsb0 ;
        /*81b0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*8920*/               @P0 BRA 0x7420 ;
    """
    # R106 is read by the first wgmma (R104-R107) before the group is waited for
    assert hazard_addresses(grouped) == ["0x7ef0"]


def test_a_listing_moved_along_reads_the_same_at_its_own_addresses():
    """A raw run lays kernels end to end: a kernel 0x10000 bytes in shows every address
    and branch target that much further on; moved back, it reads as when alone."""
    program = sass.parse(PIPELINED)
    further = [sass.moved(ins, 0x10000) for ins in program]
    assert [ins.address - 0x10000 for ins in further] == [ins.address for ins in program]
    assert [ins.branch_target() for ins in further if ins.opcode == "BRA"] == [0x14310]
    assert sass.scan_program(further).hazards[0].address == 0x144E0
    back = [sass.moved(ins, -0x10000) for ins in further]
    assert back == program
    assert sass.scan_program(back) == sass.scan(PIPELINED)
