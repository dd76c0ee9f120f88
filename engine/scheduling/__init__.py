"""Scheduling: which requests run each step, under the token budget and the sequence cap.

The scheduler, its waiting queue, preemption, the priority policy's protected steps and the
step-cost model they read, and the roll-back of a step a more urgent arrival cut short."""
