"""Actor Critic Method (keras-io), the CartPole actor-critic with one update per episode.

Source: https://keras.io/examples/rl/actor_critic_cartpole/ (keras-team/keras-io,
examples/rl/actor_critic_cartpole.py), Apache-2.0.
Adapted: gym's CartPole-v0 is replaced by `CartPoleLike`, a small deterministic NumPy cart-pole
with the same interface (reset() -> 4 floats, step(action) -> (state, reward, done)) whose
episodes end when the cart or pole leaves its bound or after `max_steps` steps (30 "bench",
8 "tiny"); the shared hidden layer has 32 units instead of 128. The loop is the example's: the
whole episode runs under `tf.GradientTape`, the action is drawn with
`np.random.choice(num_actions, p=np.squeeze(action_probs))`, the histories are Python lists,
returns are discounted and normalized in NumPy, actor loss + Huber critic loss, one
`apply_gradients` per episode. The episode (the example's `with tf.GradientTape()` block) is
factored into `train_episode`, which `decorate` wraps. One training step = one episode;
`steps` episodes instead of "until solved".
"""
import keras
import numpy as np
import tensorflow as tf
from keras import layers

from ._util import identity, seed_all, values

SOURCE = "https://keras.io/examples/rl/actor_critic_cartpole/"
LICENSE = "Apache-2.0"
TRAIT = ("whole episode under the tape: one model call per environment step, NumPy sampling "
         "from the model's output inside the tape, variable episode length, Python-list losses")
SIZES = {"bench": dict(max_steps=30, num_hidden=32, init=0.05),
         "tiny": dict(max_steps=8, num_hidden=8, init=0.25)}


class CartPoleLike:
    """A cart-pole in NumPy (Euler steps): state (x, x_dot, theta, theta_dot), action 0/1 pushes
    left/right, reward 1 per step, done when |x| > 2.4, |theta| > 12 degrees or after max_steps."""

    def __init__(self, seed, max_steps, init=0.05):
        self.rng = np.random.RandomState(seed)
        self.max_steps, self.init = max_steps, init
        self.state, self.t = None, 0

    def reset(self):
        self.state = self.rng.uniform(-self.init, self.init, size=4)
        self.t = 0
        return self.state.astype(np.float32)

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        gravity, masscart, masspole, length, tau = 9.8, 1.0, 0.1, 0.5, 0.02
        total_mass, polemass_length = masscart + masspole, masspole * length
        force = 10.0 if action == 1 else -10.0
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + polemass_length * theta_dot**2 * sintheta) / total_mass
        thetaacc = (gravity * sintheta - costheta * temp) / (
            length * (4.0 / 3.0 - masspole * costheta**2 / total_mass))
        xacc = temp - polemass_length * thetaacc * costheta / total_mass
        x, x_dot = x + tau * x_dot, x_dot + tau * xacc
        theta, theta_dot = theta + tau * theta_dot, theta_dot + tau * thetaacc
        self.state = np.array([x, x_dot, theta, theta_dot])
        self.t += 1
        done = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360 or self.t >= self.max_steps)
        return self.state.astype(np.float32), 1.0, done


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    seed_all(seed)

    # Configuration parameters for the whole setup
    gamma = 0.99  # Discount factor for past rewards
    max_steps_per_episode = c["max_steps"] + 1
    env = CartPoleLike(seed, c["max_steps"], c["init"])  # Create the environment
    eps = np.finfo(np.float32).eps.item()  # Smallest number such that 1.0 + eps != 1.0

    num_inputs = 4
    num_actions = 2
    num_hidden = c["num_hidden"]

    inputs = layers.Input(shape=(num_inputs,))
    common = layers.Dense(num_hidden, activation="relu")(inputs)
    action = layers.Dense(num_actions, activation="softmax")(common)
    critic = layers.Dense(1)(common)

    model = keras.Model(inputs=inputs, outputs=[action, critic])

    optimizer = keras.optimizers.Adam(learning_rate=0.01)
    huber_loss = keras.losses.Huber()
    action_probs_history = []
    critic_value_history = []
    rewards_history = []
    running_reward = 0
    episode_count = 0

    def train_episode(state):
        episode_reward = 0
        with Tape() as tape:
            for timestep in range(1, max_steps_per_episode):
                state = tf.convert_to_tensor(state)
                state = tf.expand_dims(state, 0)

                # Predict action probabilities and estimated future rewards
                # from environment state
                action_probs, critic_value = model(state)
                critic_value_history.append(critic_value[0, 0])

                # Sample action from action probability distribution
                action = np.random.choice(num_actions, p=np.squeeze(action_probs))
                action_probs_history.append(tf.math.log(action_probs[0, action]))

                # Apply the sampled action in our environment
                state, reward, done = env.step(action)
                rewards_history.append(reward)
                episode_reward += reward

                if done:
                    break

            # Calculate expected value from rewards
            returns = []
            discounted_sum = 0
            for r in rewards_history[::-1]:
                discounted_sum = r + gamma * discounted_sum
                returns.insert(0, discounted_sum)

            # Normalize
            returns = np.array(returns)
            returns = (returns - np.mean(returns)) / (np.std(returns) + eps)
            returns = returns.tolist()

            # Calculating loss values to update our network
            history = zip(action_probs_history, critic_value_history, returns)
            actor_losses = []
            critic_losses = []
            for log_prob, value, ret in history:
                diff = ret - value
                actor_losses.append(-log_prob * diff)  # actor loss
                critic_losses.append(
                    huber_loss(tf.expand_dims(value, 0), tf.expand_dims(ret, 0))
                )

            # Backpropagation
            loss_value = sum(actor_losses) + sum(critic_losses)
            grads = tape.gradient(loss_value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

            # Clear the loss and reward history
            action_probs_history.clear()
            critic_value_history.clear()
            rewards_history.clear()
        return loss_value, episode_reward

    train_episode = (decorate or identity)(train_episode)
    losses, running = [], []
    while episode_count < steps:  # the example runs until solved
        state = env.reset()
        loss_value, episode_reward = train_episode(state)
        losses.append(float(loss_value))

        # Update running reward to check condition for solving
        running_reward = 0.05 * float(episode_reward) + (1 - 0.05) * running_reward
        running.append(running_reward)
        if on_step is not None:
            on_step(episode_count)
        episode_count += 1
    return {"losses": losses + running, "variables": values(model, optimizer)}
