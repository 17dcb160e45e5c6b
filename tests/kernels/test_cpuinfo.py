"""/proc/cpuinfo read in one place (engine/cpu.py): the blocks, the first processor's fields, the
model name wherever the kernel puts it."""
from engram_stream.engine.cpu import cpu_model, cpuinfo_blocks

X86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: EPYC  X\nflags\t\t: avx2 fma\n\n"
       "processor\t: 1\nmodel name\t: Other\n\n")
# an aarch64 board: per-core blocks without a model name, then the board's block
ARM = ("processor\t: 0\nFeatures\t: fp asimd\nCPU part\t: 0xd08\n\nprocessor\t: 1\nFeatures\t: fp asimd\n\n"
       "Hardware\t: BCM2835\nModel\t\t: Raspberry Pi 4 Model B Rev 1.4\n")


def test_blocks_keep_each_processor_apart_and_collapse_whitespace(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(X86)
    blocks = cpuinfo_blocks(str(f))
    assert [b["processor"] for b in blocks] == ["0", "1"]
    assert blocks[0]["model name"] == "EPYC X" and blocks[0]["flags"] == "avx2 fma"
    assert cpu_model(blocks) == "EPYC X"                     # the first processor's
    assert cpuinfo_blocks(str(tmp_path / "missing")) == [] and cpu_model([]) is None


def test_the_model_of_a_board_comes_from_its_last_block(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(ARM)
    blocks = cpuinfo_blocks(str(f))
    assert len(blocks) == 3 and "Model" not in blocks[0]
    assert cpu_model(blocks) == "Raspberry Pi 4 Model B Rev 1.4"
