"""The two sentences of policy that every report, anomaly record and alert carries."""

SPECIALIZATION = (
    "Head existence does not establish specialization: that needs a task metric plus controlled head "
    "ablation with random and magnitude-matched controls, confidence intervals and repeats across seeds "
    "or checkpoints."
)
NOT_PRUNING = "A low-diversity alert is a prompt for investigation, not an automatic pruning command."


def policy_fields() -> dict[str, str]:
    return {"specialization": SPECIALIZATION, "alerts": NOT_PRUNING}
