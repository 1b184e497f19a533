"""The controlled head-ablation study's model-free parts: which heads to compare with
(``design``), the statistics and the verdict (``verdict``), the result file and the
HTML report (``report``). Running a model lives in ``monitor.integrations.ablation_study``."""
