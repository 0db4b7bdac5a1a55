"""Op types that every layer treats by kind: one table here, read by tracing, compiler and
runtime alike (the way JAX keys rules by primitive)."""

# Stateful random ops without a Generator: each eager call draws from a kernel whose state TF
# keeps per (seed, seed2) attrs and per op instance; a graph's copy of the op draws another
# sequence. (RandomGammaGrad is pure; it is listed so that function bodies holding it are
# reported with the others.)
UNSEEDED_RANDOM_OPS = frozenset({
    "RandomStandardNormal", "RandomUniform", "RandomUniformInt", "TruncatedNormal",
    "Multinomial", "RandomShuffle", "RandomGamma", "RandomGammaGrad", "RandomPoisson",
    "RandomPoissonV2", "ParameterizedTruncatedNormal", "RandomCrop", "RandomBinomial"})

# Host ops run on the program's thread, at the moment the program issues them, exactly as often
# as in eager, and never in a generated graph:
# - their effect lies outside TF's variables (printing, writing summaries, taking the next element
#   of a tf.data iterator, drawing from a stateful random kernel), so a graph that runs ahead of
#   Python, or an eager replay of ops Python already went through, would repeat or reorder it;
# - skip mode matches the record, then runs the op for real on its fetched inputs; its outputs
#   are real tensors, which the ops that consume them take as feeds (the recorder never lists
#   them as produced values, so the traced path already has feeds there);
# - a generated graph leaves the op out but still dequeues its feeds, keeping the channels in
#   step; a resource input (a summary writer, an iterator) is taken by role, not by identity
#   (each epoch makes a new iterator).
HOST_OPS = frozenset({
    "PrintV2", "WriteSummary", "WriteScalarSummary", "WriteHistogramSummary",
    "WriteImageSummary", "WriteAudioSummary", "WriteGraphSummary", "WriteRawProtoSummary",
    "FlushSummaryWriter", "IteratorGetNext", "IteratorGetNextSync",
}) | (UNSEEDED_RANDOM_OPS - {"RandomGammaGrad"})


# A `tf.data` iterator's life: made (a new epoch's `for x in dataset`), started, read, dropped.
# A trace whose step is followed by a dataset or iterator being made is cut before it
# (runtime/sites.py `state_tail`): what follows is the program's own eager work between steps
# (an epoch's end: Keras' validation pass, the next epoch's iterator), not part of the step.
ITERATOR_OPS = frozenset({
    "AnonymousIteratorV2", "AnonymousIteratorV3", "MakeIterator", "DeleteIterator",
    "IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "OptionalHasValue",
    "OptionalGetValue", "OptionalNone",
})


def makes_data_pipeline(op_type: str) -> bool:
    """A `tf.data` dataset or iterator op (`TensorSliceDataset`, `AnonymousIteratorV3`, ...)."""
    return op_type in ITERATOR_OPS or op_type.endswith(("Dataset", "DatasetV2", "DatasetV3"))


# Ops whose output length depends on the values of their inputs: a coarse unit holding one may
# have built its later ops from that length (the Python inside read `.shape`, free when eager),
# so it is not skipped whole (terra/runtime/sites.py, `units_for`).
DATA_DEPENDENT_SHAPE_OPS = frozenset({
    "Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2", "ListDiff",
    "DynamicPartition", "NonMaxSuppression", "NonMaxSuppressionV2", "NonMaxSuppressionV3",
    "NonMaxSuppressionV4", "NonMaxSuppressionV5", "NonMaxSuppressionWithOverlaps",
    "CombinedNonMaxSuppression", "Bincount", "DenseBincount", "RaggedRange",
})


# Ops whose kernels raise only for shapes and dtypes, which a compiled path fixes, never for a
# value (no index, size or divisor taken from a tensor): inside a program's `try`/`except`, any
# other op is a sync point, so that its error is raised there, as in eager
# (terra/runtime/path_view.py, `barrier_records`).
VALUE_SAFE_OPS = frozenset({
    "Identity", "IdentityN", "StopGradient", "ReadVariableOp", "Cast", "Shape", "ShapeN", "Size",
    "Rank", "ZerosLike", "OnesLike", "Const",
    "AddV2", "Add", "AddN", "Sub", "Mul", "MulNoNan", "RealDiv", "DivNoNan", "Neg", "Abs", "Sign",
    "Square", "SquaredDifference", "Sqrt", "Rsqrt", "Reciprocal", "Exp", "Expm1", "Log", "Log1p",
    "Pow", "Maximum", "Minimum", "Floor", "Ceil", "Round", "Relu", "Relu6", "Elu", "Selu",
    "LeakyRelu", "Softplus", "Softsign", "Sigmoid", "Tanh", "Erf", "ReluGrad", "Relu6Grad",
    "EluGrad", "SeluGrad", "LeakyReluGrad", "SoftplusGrad", "SigmoidGrad", "TanhGrad",
    "SqrtGrad", "RsqrtGrad", "ReciprocalGrad",
    "Greater", "GreaterEqual", "Less", "LessEqual", "Equal", "NotEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "Select", "SelectV2", "IsNan", "IsInf", "IsFinite",
    "MatMul", "BatchMatMulV2", "BatchMatMulV3", "BiasAdd", "BiasAddGrad", "Conv2D",
    "Conv2DBackpropInput", "Conv2DBackpropFilter", "MaxPool", "MaxPoolGrad", "AvgPool",
    "AvgPoolGrad", "FusedBatchNormV3", "FusedBatchNormGradV3", "Softmax", "LogSoftmax",
    "SoftmaxCrossEntropyWithLogits", "Sum", "Mean", "Max", "Min", "Prod", "Transpose",
    "ConcatV2", "Pack", "Unpack", "ExpandDims", "Squeeze", "BroadcastGradientArgs",
})
