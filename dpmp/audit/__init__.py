"""Audits: precision from the compiled step's jaxpr, numeric sensitivity of sums,
and empirical privacy from the step's outputs.

The precision audit (``_precision``) is one walker over the jaxpr (``_jaxpr``)
and a table of rules, one module per primitive family (``rules/``).
"""

from dpmp.audit._numeric import NumericReport as NumericReport
from dpmp.audit._numeric import fp_sum_sensitivity as fp_sum_sensitivity
from dpmp.audit._numeric import numeric_audit as numeric_audit
from dpmp.audit._precision import KINDS as KINDS
from dpmp.audit._precision import Finding as Finding
from dpmp.audit._precision import PrecisionAuditError as PrecisionAuditError
from dpmp.audit._precision import PrecisionReport as PrecisionReport
from dpmp.audit._precision import audit_precision as audit_precision
from dpmp.audit._privacy import PrivacyAuditReport as PrivacyAuditReport
from dpmp.audit._privacy import privacy_audit as privacy_audit

__all__ = [
    "KINDS",
    "Finding",
    "PrecisionAuditError",
    "PrecisionReport",
    "audit_precision",
    "NumericReport",
    "fp_sum_sensitivity",
    "numeric_audit",
    "PrivacyAuditReport",
    "privacy_audit",
]
