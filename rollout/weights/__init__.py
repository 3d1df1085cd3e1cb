"""One weight path: names and coercion, bucket layout, sender, receiver (broadcast, handles, disk).

Every path ends in ``Engine.update_weights(pairs, version)``, which alone decides the policy version.
"""
