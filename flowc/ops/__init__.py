"""The op registry; importing this package registers every op family."""

from flowc.ops import (  # noqa: F401
    attention,
    comm,
    conv,
    deform,
    elementwise,
    index,
    linalg,
    matmul,
    ml,
    norm,
    pool,
    quant,
    reduce,
    resize,
    rnn,
    sample,
    signal,
    softmax,
    training,
)
