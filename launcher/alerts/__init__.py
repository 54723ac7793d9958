"""Alerts: what the pod decided, told to the user's webhooks while they are away; an alert
never blocks or crashes supervision. Events -> rules.py -> router.py (one message per
incident) -> senders.py (a thread per webhook) -> formats.py, webhooks.py.
"""
