"""A small residual CNN (basic blocks) shared by the DropBlock and SDPoint programs."""
import keras
from keras import layers

# size -> stage widths, image side, batch, classes
CONVNET_SIZES = {
    "bench": dict(widths=(32, 64, 128), blocks=2, hw=32, batch=16, classes=10),
    "tiny": dict(widths=(4, 8), blocks=1, hw=8, batch=2, classes=4),
}


class BasicBlock(layers.Layer):
    def __init__(self, filters, stride=1, **kw):
        super().__init__(**kw)
        self.c1 = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False)
        self.b1 = layers.BatchNormalization()
        self.c2 = layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.b2 = layers.BatchNormalization()
        self.stride, self.filters = stride, filters
        self.proj = None

    def build(self, shape):
        if self.stride != 1 or shape[-1] != self.filters:
            self.proj = layers.Conv2D(self.filters, 1, self.stride, use_bias=False)

    def call(self, x, training=False):
        y = keras.ops.relu(self.b1(self.c1(x), training=training))
        y = self.b2(self.c2(y), training=training)
        s = self.proj(x) if self.proj is not None else x
        return keras.ops.relu(s + y)
