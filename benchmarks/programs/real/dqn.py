"""Deep Q-Learning for Atari Breakout (keras-io), the DQN with replay buffers and a target network.

Source: https://keras.io/examples/rl/deep_q_network_breakout/ (keras-team/keras-io,
examples/rl/deep_q_network_breakout.py), Apache-2.0.
Adapted: Atari Breakout (gym, AtariPreprocessing, FrameStack of 4 84x84 frames) is replaced by
`TinyBreakout`, a deterministic NumPy Breakout (wall, bricks, ball, paddle) whose observation
is a stack of the last 2 frames, channels first like the example's (2x24x24 "bench", 2x16x16
"tiny"); the Q network
keeps the example's shape (transpose Lambda, three Conv2D, Dense, linear head) with smaller
kernels and widths; the schedule is shortened (random frames, greedy-decay frames, replay
length, target-network period, batch size). The loop is the example's: epsilon-greedy actions
with `np.random`, replay buffers as Python lists, `np.random.choice(range(len(done_history)),
size=batch_size)`, target Q-values from `model_target(state_next_sample)` (the example's
`model_target.predict`), a `one_hot` action mask, the Huber loss under `tf.GradientTape`, Adam
with clipnorm, `model_target.set_weights(model.get_weights())` every `update_target_network`
frames. The update (target Q-values, tape, apply_gradients) is factored into `train_step`,
which `decorate` wraps; the sampled lists reach it as arrays. One training step = one gradient
update (every `update_after_actions` frames); frames run until `steps` updates happened.
"""
import keras
import numpy as np
import tensorflow as tf
from keras import layers

from ._util import identity, seed_all, values

SOURCE = "https://keras.io/examples/rl/deep_q_network_breakout/"
LICENSE = "Apache-2.0"
TRAIT = ("replay-buffer DQN: Python-list buffers sampled with np.random, eager greedy-action "
         "model calls between updates, target network and weight copies via get/set_weights")
SIZES = {
    "bench": dict(frame=24, filters=(16, 32, 32), dense=128, batch_size=32,
                  epsilon_random_frames=64, epsilon_greedy_frames=2000.0,
                  max_memory_length=500, update_target_network=200, max_steps_per_episode=200),
    "tiny": dict(frame=16, filters=(4, 8, 8), dense=16, batch_size=8,
                 epsilon_random_frames=12, epsilon_greedy_frames=100.0,
                 max_memory_length=40, update_target_network=16, max_steps_per_episode=40),
}


class TinyBreakout:
    """Breakout in NumPy on a size x size screen: a wall on the top row, three rows of bricks
    below it, a ball moving diagonally and a 3-pixel paddle on the bottom row. Actions as
    Breakout's: 0 noop, 1 fire (noop), 2 right, 3 left. Reward 1 per brick hit (the ball
    bounces back down); the episode ends when the ball passes the paddle. Observations: the
    last 2 frames, shape (2, size, size), float32 in [0, 1]."""

    def __init__(self, seed, size):
        self.rng = np.random.RandomState(seed)
        self.size = size

    def _frame(self):
        n = self.size
        f = np.zeros((n, n), np.float32)
        f[0, :] = 0.25
        f[1:4, :] = 0.5 * self.bricks
        f[n - 1, self.px - 1:self.px + 2] = 0.75
        f[self.by, self.bx] = 1.0
        return f

    def reset(self):
        n = self.size
        self.bricks = np.ones((3, n), np.float32)
        self.bx, self.by = self.rng.randint(0, n), self.rng.randint(4, n // 2 + 2)
        self.dx, self.dy = self.rng.choice([-1, 1]), self.rng.choice([-1, 1])
        self.px = self.rng.randint(1, n - 1)
        f = self._frame()
        self.frames = [f, f]
        return np.stack(self.frames), {}

    def step(self, action):
        n = self.size
        self.px = int(np.clip(self.px + {2: 1, 3: -1}.get(int(action), 0), 1, n - 2))
        self.bx += self.dx
        if self.bx < 0 or self.bx >= n:
            self.dx, self.bx = -self.dx, self.bx - 2 * self.dx
        self.by += self.dy
        reward, done = 0.0, False
        if self.by < 1:
            self.dy, self.by = 1, 2 - self.by
        if 1 <= self.by <= 3 and self.bricks[self.by - 1, self.bx] > 0:
            self.bricks[self.by - 1, self.bx] = 0.0
            self.dy, reward = 1, 1.0
        elif self.by >= n - 1:
            if abs(self.bx - self.px) <= 1:
                self.dy, self.by = -1, n - 3
            else:
                self.by, done = n - 1, True
        self.frames = [self.frames[1], self._frame()]
        return np.stack(self.frames), reward, done, False, {}


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    seed_all(seed)

    # Configuration paramaters for the whole setup
    gamma = 0.99  # Discount factor for past rewards
    epsilon = 1.0  # Epsilon greedy parameter
    epsilon_min = 0.1  # Minimum epsilon greedy parameter
    epsilon_max = 1.0  # Maximum epsilon greedy parameter
    epsilon_interval = (
        epsilon_max - epsilon_min
    )  # Rate at which to reduce chance of random action being taken
    batch_size = c["batch_size"]  # Size of batch taken from replay buffer
    max_steps_per_episode = c["max_steps_per_episode"]

    env = TinyBreakout(seed, c["frame"])
    frame, (f1, f2, f3) = c["frame"], c["filters"]
    num_actions = 4

    def create_q_model():
        return keras.Sequential(
            [
                keras.Input(shape=(2, frame, frame)),
                layers.Lambda(
                    lambda tensor: keras.ops.transpose(tensor, [0, 2, 3, 1]),
                    output_shape=(frame, frame, 2),
                ),
                # Convolutions on the frames on the screen
                layers.Conv2D(f1, 4, strides=2, activation="relu"),
                layers.Conv2D(f2, 3, strides=2, activation="relu"),
                layers.Conv2D(f3, 3, strides=1, activation="relu"),
                layers.Flatten(),
                layers.Dense(c["dense"], activation="relu"),
                layers.Dense(num_actions, activation="linear"),
            ]
        )

    # The first model makes the predictions for Q-values which are used to
    # make a action.
    model = create_q_model()
    # Build a target model for the prediction of future rewards.
    model_target = create_q_model()

    optimizer = keras.optimizers.Adam(learning_rate=0.00025, clipnorm=1.0)

    # Experience replay buffers
    action_history = []
    state_history = []
    state_next_history = []
    rewards_history = []
    done_history = []
    episode_reward_history = []
    running_reward = 0
    episode_count = 0
    frame_count = 0
    # Number of frames to take random action and observe output
    epsilon_random_frames = c["epsilon_random_frames"]
    # Number of frames for exploration
    epsilon_greedy_frames = c["epsilon_greedy_frames"]
    # Maximum replay length
    max_memory_length = c["max_memory_length"]
    # Train the model after 4 actions
    update_after_actions = 4
    # How often to update the target network
    update_target_network = c["update_target_network"]
    # Using huber loss for stability
    loss_function = keras.losses.Huber()

    def train_step(state_sample, state_next_sample, rewards_sample, action_sample, done_sample):
        # Build the updated Q-values for the sampled future states
        # Use the target model for stability
        future_rewards = model_target(state_next_sample)
        # Q value = reward + discount factor * expected future reward
        updated_q_values = rewards_sample + gamma * keras.ops.amax(
            future_rewards, axis=1
        )

        # If final frame set the last value to -1
        updated_q_values = updated_q_values * (1 - done_sample) - done_sample

        # Create a mask so we only calculate loss on the updated Q-values
        masks = keras.ops.one_hot(action_sample, num_actions)

        with Tape() as tape:
            # Train the model on the states and updated Q-values
            q_values = model(state_sample)

            # Apply the masks to the Q-values to get the Q-value for action taken
            q_action = keras.ops.sum(keras.ops.multiply(q_values, masks), axis=1)
            # Calculate loss between new Q-value and old Q-value
            loss = loss_function(updated_q_values, q_action)

        # Backpropagation
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    train_step = (decorate or identity)(train_step)
    losses, updates = [], 0
    while updates < steps:  # the example runs until solved or max_episodes
        observation, _ = env.reset()
        state = np.array(observation)
        episode_reward = 0

        for timestep in range(1, max_steps_per_episode):
            frame_count += 1

            # Use epsilon-greedy for exploration
            if frame_count < epsilon_random_frames or epsilon > np.random.rand(1)[0]:
                # Take random action
                action = np.random.choice(num_actions)
            else:
                # Predict action Q-values
                # From environment state
                state_tensor = keras.ops.convert_to_tensor(state)
                state_tensor = keras.ops.expand_dims(state_tensor, 0)
                action_probs = model(state_tensor, training=False)
                # Take best action
                action = keras.ops.argmax(action_probs[0]).numpy()

            # Decay probability of taking random action
            epsilon -= epsilon_interval / epsilon_greedy_frames
            epsilon = max(epsilon, epsilon_min)

            # Apply the sampled action in our environment
            state_next, reward, done, _, _ = env.step(action)
            state_next = np.array(state_next)

            episode_reward += reward

            # Save actions and states in replay buffer
            action_history.append(action)
            state_history.append(state)
            state_next_history.append(state_next)
            done_history.append(done)
            rewards_history.append(reward)
            state = state_next

            # Update every fourth frame and once batch size is over 32
            if frame_count % update_after_actions == 0 and len(done_history) > batch_size:
                # Get indices of samples for replay buffers
                indices = np.random.choice(range(len(done_history)), size=batch_size)

                # Using list comprehension to sample from replay buffer
                state_sample = np.array([state_history[i] for i in indices])
                state_next_sample = np.array([state_next_history[i] for i in indices])
                rewards_sample = np.array([rewards_history[i] for i in indices], np.float32)
                action_sample = np.array([action_history[i] for i in indices])
                done_sample = keras.ops.convert_to_tensor(
                    [float(done_history[i]) for i in indices]
                )

                loss = train_step(state_sample, state_next_sample, rewards_sample,
                                  action_sample, done_sample)
                losses.append(float(loss))
                if on_step is not None:
                    on_step(updates)
                updates += 1

            if frame_count % update_target_network == 0:
                # update the the target network with new weights
                model_target.set_weights(model.get_weights())

            # Limit the state and reward history
            if len(rewards_history) > max_memory_length:
                del rewards_history[:1]
                del state_history[:1]
                del state_next_history[:1]
                del action_history[:1]
                del done_history[:1]

            if done or updates == steps:
                break

        # Update running reward to check condition for solving
        episode_reward_history.append(episode_reward)
        if len(episode_reward_history) > 100:
            del episode_reward_history[:1]
        running_reward = np.mean(episode_reward_history)

        episode_count += 1
    return {"losses": losses + [float(running_reward)],
            "variables": values(model, model_target, optimizer)}
