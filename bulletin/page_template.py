"""The status page's HTML (Jinja2, autoescaped; plots come in as matplotlib SVG and are marked safe).

No scripts, no build step: plain HTML and CSS the bulletin renders per request.
"""

from __future__ import annotations

from typing import NamedTuple

from jinja2 import DictLoader, Environment


class Plot(NamedTuple):
    """A plot of the page: its SVG element, or the note shown instead when it could not be drawn."""

    svg: str | None = None
    error: str | None = None


# A backslash ending a template line joins it to the next: the template holds no newline there.
_BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }} - stitchboard</title>
<style>
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
.dead { color: #999; } .error { color: #a02020; max-width: 40rem; } .ok { color: #207020; }
.summary span { margin-right: 1.5rem; } svg { max-width: 100%; height: auto; }
</style></head><body>
<p><a href="/status">runs</a>{% if logged_in %} · <form method="post" action="/status/logout" style="display:inline">\
<button>log out</button></form>{% endif %}</p>
{% block body %}{% endblock %}
</body></html>"""

_LOGIN = """{% extends "base" %}{% block body %}
<h1>stitchboard bulletin</h1>
<p>This bulletin needs a token (any scope that may read).</p>
{% if error %}<p class="error" id="login-error">{{ error }}</p>{% endif %}
<form method="post" action="/status/login">
<label>token <input type="password" name="token" id="token" autocomplete="off"></label>
<button type="submit" id="login">show the status</button>
</form>{% endblock %}"""

_RUNS = """{% extends "base" %}{% block body %}
<h1>runs</h1>
<table id="runs"><tr><th>run</th><th>latest version</th></tr>
{% for r in runs %}<tr><td><a href="/status/runs/{{ r.run_id }}">{{ r.run_id }}</a></td><td>\
{{ r.latest_version if r.latest_version is not none else "none" }}</td></tr>
{% else %}<tr><td colspan="2">no runs</td></tr>{% endfor %}
</table>{% endblock %}"""

_RUN = """{% extends "base" %}{% macro plot(p) %}{% if p.svg is not none %}{{ p.svg | safe }}{% else %}\
<p class="error plot-failed">{{ p.error }}; the tables below are complete.</p>{% endif %}{% endmacro %}{% block body %}
<h1>run {{ run }}</h1>
<p class="summary"><span>latest version <b id="latest-version">\
{{ view.latest_version if view.latest_version is not none else "none" }}</b></span>
<span>live replicas <b id="live-replicas">{{ live }}</b></span>
<span>at the latest version <b id="at-latest">{{ at_latest }}</b></span>
<span>expired <b id="expired-replicas">{{ view.replicas | length - live }}</b></span></p>
<h2>versions</h2>
<div id="timeline">{{ plot(timeline) }}</div>
<h2>fleet</h2>
<div id="convergence">{{ plot(convergence) }}</div>
<h2>replicas</h2>
<table id="replicas"><tr><th>replica</th><th>engine</th><th>applied</th><th>target</th><th>behind latest</th>\
<th>state</th><th>live</th><th>resident adapters</th>
<th>last sync (bytes, s, pause s)</th><th>last error</th></tr>
{% for r in view.replicas %}<tr class="replica {{ '' if r.live else 'dead' }}" data-replica="{{ r.report.replica_id }}">
<td>{{ r.report.replica_id }}</td><td>{{ r.report.engine }}</td><td class="applied">\
{{ r.report.applied_version if r.report.applied_version is not none else "none" }}</td>
<td>{{ r.report.target_version if r.report.target_version is not none else "none" }}</td><td>\
{{ r.behind_latest if r.behind_latest is not none else "-" }}</td>
<td class="{{ 'ok' if r.report.healthy else 'error' }}">{{ r.report.state }}</td><td>\
{{ "yes" if r.live else "expired" }}</td>
<td class="adapters">{{ r.report.adapters | join(", ") if r.report.adapters else "-" }}</td>
<td>{% if r.report.last_sync %}v{{ r.report.last_sync.to_version }}: \
{{ "{:,}".format(r.report.last_sync.bytes_fetched) }} B, {{ "%.3f" | format(r.report.last_sync.total_seconds) }} s, \
{{ "%.3f" | format(r.report.last_sync.pause_seconds) }} s ({{ r.report.last_sync.route }}){% else %}-{% endif %}</td>
<td class="error">{% if r.report.last_error %}{{ r.report.last_error.type }}: {{ r.report.last_error.message }}\
{% endif %}</td></tr>
{% else %}<tr><td colspan="10">no replica reports to this bulletin</td></tr>{% endfor %}
</table>
<h2>version list</h2>
<table id="versions"><tr><th>version</th><th>anchor</th><th>delta bytes</th><th>snapshot bytes</th><th>% changed</th>\
<th>committed</th></tr>
{% for v in versions | reverse %}<tr><td>{{ v.version }}</td><td>{{ "anchor" if v.snapshot else "" }}</td><td>\
{{ "{:,}".format(v.size_bytes) }}</td>
<td>{{ "{:,}".format(v.snapshot_bytes) }}</td><td>{{ "%.4f" | format(changed.get(v.version, 0.0)) }}</td><td>\
{{ v.committed_at }}</td></tr>{% endfor %}
</table>{% endblock %}"""

_ENV = Environment(loader=DictLoader({"base": _BASE, "login": _LOGIN, "runs": _RUNS, "run": _RUN}), autoescape=True)
#: The templates: ``LOGIN(error, logged_in)``, ``RUNS(runs, logged_in)``,
#: ``RUN(run, view, live, at_latest, timeline, convergence, versions, changed, logged_in)`` (the plots: :class:`Plot`).
LOGIN, RUNS, RUN = (_ENV.get_template(name) for name in ("login", "runs", "run"))
