"""A YOLOv3-like detector: Darknet-style residual backbone with leaky ReLU, two detection scales
joined by nearest-neighbour upsampling (ResizeNearestNeighbor) and a loss that masks cells with
``tf.where``, as in the yolov3-tf2 implementation. Trait: ResizeNearestNeighbor and Where, which
XLA does not compile (no kernel for ResizeNearestNeighborGrad)."""
import keras
import numpy as np
import tensorflow as tf
from keras import layers

from ._common import Program

SIZES = {
    "bench": dict(hw=64, width=16, blocks=(1, 2, 2, 2), batch=4, classes=4, anchors=3),
    "tiny": dict(hw=16, width=4, blocks=(1, 1), batch=1, classes=2, anchors=1),
}


def conv(x, f, k=3, s=1):
    x = layers.Conv2D(f, k, s, padding="same", use_bias=False)(x)
    return layers.LeakyReLU(0.1)(layers.BatchNormalization()(x))


def darknet_stage(x, f, n):
    x = conv(x, f, 3, 2)
    for _ in range(n):
        x = layers.Add()([x, conv(conv(x, f // 2, 1), f)])
    return x


def upsample_nearest(x):
    return tf.image.resize(x, (2 * x.shape[1], 2 * x.shape[2]), method="nearest")


def yolo(hw, width, blocks, classes, anchors, **_):
    inp = keras.Input((hw, hw, 3))
    x = conv(inp, width)
    feats = []
    for s, n in enumerate(blocks):
        x = darknet_stage(x, width * 2 ** (s + 1), n)
        feats.append(x)
    out_ch = anchors * (5 + classes)
    big = conv(feats[-1], width * 4, 1)
    head_big = layers.Conv2D(out_ch, 1)(conv(big, width * 8))
    up = layers.Lambda(upsample_nearest)(conv(big, width * 2, 1))
    small = conv(layers.Concatenate()([up, feats[-2]]), width * 4)
    head_small = layers.Conv2D(out_ch, 1)(small)
    return keras.Model(inp, [head_big, head_small])


class YOLOv3Like(Program):
    name = "yolov3_like"
    trait = "nearest-neighbour upsampling and tf.where masks (XLA has no kernel for the grad)"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = self.c = SIZES[size]
        self.model = yolo(**c)
        self.optimizer = keras.optimizers.Adam(1e-3)
        r, b, a, k = self.np_rng, c["batch"], c["anchors"], c["classes"]
        grids = [o.shape[1] for o in self.model.outputs]
        self.batches = []
        for _ in range(self.pool_size):
            targets = []
            for g in grids:
                obj = (r.uniform(size=(b, g, g, a)) < 0.1).astype(np.float32)
                box = r.uniform(size=(b, g, g, a, 4)).astype(np.float32)
                cls = r.integers(0, k, (b, g, g, a))
                targets += [tf.constant(obj), tf.constant(box), tf.constant(cls)]
            self.batches.append((tf.constant(r.standard_normal((b, c["hw"], c["hw"], 3)), tf.float32), *targets))

    def yolo_loss(self, out, obj, box, cls):
        a, k = self.c["anchors"], self.c["classes"]
        out = tf.reshape(out, tf.concat([tf.shape(out)[:3], [a, 5 + k]], 0))
        pred_box, pred_obj, pred_cls = tf.sigmoid(out[..., :4]), out[..., 4], out[..., 5:]
        has_obj = obj > 0.5
        obj_loss = tf.nn.sigmoid_cross_entropy_with_logits(obj, pred_obj)
        box_loss = tf.where(has_obj, tf.reduce_sum(tf.square(box - pred_box), -1), 0.0)
        cls_loss = tf.where(has_obj, tf.nn.sparse_softmax_cross_entropy_with_logits(cls, pred_cls), 0.0)
        return tf.reduce_sum(obj_loss + box_loss + cls_loss) / tf.cast(tf.shape(out)[0], tf.float32)

    def train_step(self, images, *targets):
        with self.tape_cls() as tape:
            outs = self.model(images, training=True)
            loss = tf.add_n([self.yolo_loss(o, *targets[3 * j:3 * j + 3]) for j, o in enumerate(outs)])
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss


def build(tape_cls, seed=0, size="bench"):
    return YOLOv3Like(tape_cls, seed, size)
