"""A Faster R-CNN-like detector: CNN backbone, RPN (objectness + box deltas per anchor) and an RoI
classification head. As in the open-source implementations, proposals are materialized inside
the step and post-processed with numpy: anchor matching (IoU) builds the RPN targets and numpy
NMS picks the RoIs, whose boxes are fed back into the graph (crop_and_resize) and the loss.
Trait: tensor materialization (``.numpy()``) during the step; AutoGraph cannot trace it."""
import keras
import numpy as np
import tensorflow as tf
from keras import layers

from ._common import Program

SIZES = {
    "bench": dict(hw=128, width=64, batch=4, gt=4, classes=4, rois=32, pool=7),
    "tiny": dict(hw=16, width=4, batch=1, gt=2, classes=3, rois=4, pool=3),
}
SCALES = (0.2, 0.4)  # anchor sides as a fraction of the image, one anchor per scale per cell


def iou(a, b):
    """Pairwise IoU of [N,4] and [M,4] boxes (y1, x1, y2, x2), numpy."""
    tl = np.maximum(a[:, None, :2], b[None, :, :2])
    br = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(br - tl, 0, None), axis=-1)
    area = lambda z: np.prod(z[:, 2:] - z[:, :2], axis=-1)
    return inter / (area(a)[:, None] + area(b)[None] - inter + 1e-9)


def nms(boxes, scores, k, thresh=0.7):
    order, keep = np.argsort(-scores, kind="stable"), []
    while order.size and len(keep) < k:
        i = order[0]
        keep.append(i)
        order = order[1:][iou(boxes[i:i + 1], boxes[order[1:]])[0] <= thresh]
    while len(keep) < k:  # pad by repeating the best box: the RoI head needs a fixed count
        keep.append(keep[0] if keep else 0)
    return np.array(keep, np.int64)


def make_anchors(cells):
    c = (np.arange(cells) + 0.5) / cells
    cy, cx = np.meshgrid(c, c, indexing="ij")
    out = [np.stack([cy - s / 2, cx - s / 2, cy + s / 2, cx + s / 2], -1) for s in SCALES]
    return np.stack(out, 2).reshape(-1, 4).astype(np.float32)


class FasterRCNNLike(Program):
    name = "fasterrcnn_like"
    trait = "proposals materialized with .numpy(); numpy IoU matching and NMS fed back into the loss"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = self.c = SIZES[size]
        w = c["width"]
        self.backbone = keras.Sequential([
            keras.Input((c["hw"], c["hw"], 3)),
            layers.Conv2D(w, 3, 2, padding="same", activation="relu"),
            layers.Conv2D(w, 3, padding="same", activation="relu"),
            layers.Conv2D(2 * w, 3, 2, padding="same", activation="relu"),
            layers.Conv2D(2 * w, 3, padding="same", activation="relu"),
            layers.Conv2D(4 * w, 3, 2, padding="same", activation="relu"),
        ])
        cells = c["hw"] // 8
        feat = keras.Input((cells, cells, 4 * w))
        h = layers.Conv2D(4 * w, 3, padding="same", activation="relu")(feat)
        self.rpn = keras.Model(feat, [layers.Conv2D(len(SCALES), 1)(h), layers.Conv2D(4 * len(SCALES), 1)(h)])
        self.roi_head = keras.Sequential([
            keras.Input((c["pool"], c["pool"], 4 * w)),
            layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(c["classes"] + 1),
        ])
        self.optimizer = keras.optimizers.SGD(0.005, momentum=0.9)
        self.anchors = make_anchors(cells)
        r, b = self.np_rng, c["batch"]
        self.batches = []
        for _ in range(self.pool_size):
            tl = r.uniform(0, 0.6, (b, c["gt"], 2))
            boxes = np.concatenate([tl, tl + r.uniform(0.15, 0.4, (b, c["gt"], 2))], -1).clip(0, 1)
            self.batches.append((tf.constant(r.standard_normal((b, c["hw"], c["hw"], 3)), tf.float32),
                                 tf.constant(boxes, tf.float32),
                                 tf.constant(r.integers(1, c["classes"] + 1, (b, c["gt"])))))

    def models(self):
        return [self.backbone, self.rpn, self.roi_head]

    def params(self):
        return sum((m.trainable_variables for m in self.models()), [])

    def train_step(self, images, gt_boxes, gt_classes):
        b = self.c["batch"]
        with self.tape_cls() as tape:
            feat = self.backbone(images, training=True)
            obj, deltas = self.rpn(feat, training=True)
            obj = tf.reshape(obj, (b, -1))
            deltas = tf.reshape(deltas, (b, -1, 4))
            proposals = tf.clip_by_value(self.anchors[None] + 0.1 * deltas, 0.0, 1.0)
            # materialize and post-process with numpy, as the reference implementations do
            targets = self.post_process(proposals.numpy(), obj.numpy(), gt_boxes.numpy(),
                                        gt_classes.numpy())
            loss = self.loss(feat, obj, deltas, *(tf.constant(t) for t in targets))
        params = self.params()
        self.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    def post_process(self, props_np, obj_np, gt_np, cls_np):
        """The numpy part of the step: RPN labels and box targets by IoU matching, RoIs by NMS
        and their labels; (rpn labels, box targets, RoI boxes, RoI batch indices, RoI labels)."""
        rpn_labels, box_targets, roi_boxes, roi_labels, box_idx = [], [], [], [], []
        for k in range(self.c["batch"]):
            overlaps = iou(self.anchors, gt_np[k])
            rpn_labels.append((overlaps.max(1) >= 0.4).astype(np.float32))
            box_targets.append((gt_np[k][overlaps.argmax(1)] - self.anchors) / 0.1)
            keep = nms(props_np[k], obj_np[k], self.c["rois"])
            roi = props_np[k][keep]
            roi_iou = iou(roi, gt_np[k])
            roi_labels.append(np.where(roi_iou.max(1) >= 0.3, cls_np[k][roi_iou.argmax(1)], 0))
            roi_boxes.append(roi)
            box_idx.append(np.full(len(keep), k, np.int32))
        return (np.stack(rpn_labels), np.stack(box_targets), np.concatenate(roi_boxes),
                np.concatenate(box_idx), np.concatenate(roi_labels))

    def loss(self, feat, obj, deltas, pos, box_targets, roi_boxes, box_idx, roi_labels):
        """The losses on the post-processed targets (tensors)."""
        pool = self.c["pool"]
        rpn_loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(pos, obj))
        box_err = tf.reduce_sum(tf.abs(deltas - box_targets), -1)
        rpn_loss += tf.reduce_sum(pos * box_err) / tf.maximum(tf.reduce_sum(pos), 1.0)
        crops = tf.image.crop_and_resize(feat, roi_boxes, box_idx, (pool, pool))
        roi_logits = self.roi_head(crops, training=True)
        roi_loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            roi_labels, roi_logits))
        return rpn_loss + roi_loss


def build(tape_cls, seed=0, size="bench"):
    return FasterRCNNLike(tape_cls, seed, size)
