"""ds_seqpar/deepspeed_shm.py: DeepSpeed's CPU shared-memory op is marked off in DeepSpeed's own op table,
unless DS_SEQPAR_DEEPSPEED_SHM=1 keeps it. (That DeepSpeed's comm backend then starts without it, and still
sums: tests/dist/test_deepspeed_mpu.py.)"""
import pytest

from ds_seqpar.deepspeed_shm import KEEP_DEEPSPEED_SHM, skip_deepspeed_shm_op


@pytest.fixture
def op_table(monkeypatch):
    import deepspeed.ops
    table = dict(deepspeed.ops.__compatible_ops__, deepspeed_shm_comm=True)
    monkeypatch.setattr(deepspeed.ops, "__compatible_ops__", table)
    return table


def test_the_op_is_marked_off_in_deepspeeds_table(op_table):
    before = dict(op_table)
    assert skip_deepspeed_shm_op({}) is True
    assert op_table == dict(before, deepspeed_shm_comm=False)       # that op alone


def test_the_environment_keeps_it(op_table):
    assert skip_deepspeed_shm_op({KEEP_DEEPSPEED_SHM: "1"}) is False
    assert op_table["deepspeed_shm_comm"] is True
