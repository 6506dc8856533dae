"""The op registry; importing this package registers every op family."""

from flowc.ops import (  # noqa: F401
    comm,
    conv,
    elementwise,
    index,
    matmul,
    norm,
    pool,
    quant,
    reduce,
    rnn,
    sample,
    shape,
    signal,
    softmax,
    training,
)
