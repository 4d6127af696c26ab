"""Prefect task: the run report (markdown with the reward, logprob-diff and pass@k plots) as an artifact."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE


@task(name="report", cache_policy=NO_CACHE)
def publish_report(run_dir: str, *, key: str, title: str, extra_markdown: str = "",
                   links: dict[str, str] | None = None) -> dict:
    from engines.runs.report import write_report

    report = write_report(run_dir, title=title, extra_markdown=extra_markdown, links=links)
    create_markdown_artifact(report["markdown"], key=key, description=title)
    return {"summary": report["summary"], "plots": report["plots"], "report": f"{run_dir}/report.md"}
