"""Alerts: what the pod decided, told where the user is (ntfy, Slack, Discord or a generic
JSON webhook), while they are away; an alert never blocks or crashes supervision.

rules.py maps the events the launcher writes (logs/events.jsonl) to alerts with a severity;
router.py is fed each event as a mirror of the EventLog, keeps one message per incident and
hands it to senders.py, one background thread per webhook (bounded queue, bounded retries,
a summary when many fire at once) that never blocks or crashes supervision; formats.py
renders a message for each webhook kind; webhooks.py reads the URLs (secrets) from the
launcher's environment and posts. Settings: launcher/config/alerts.py.
"""
