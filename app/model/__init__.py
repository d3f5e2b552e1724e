"""The DLRM network: embedding tables (sparse arch), bottom MLP, interaction, top MLP."""

from app.model.dlrm import INTERACTIONS, DLRMConcat, build_dlrm, build_embedding_bag_collection

__all__ = ["INTERACTIONS", "DLRMConcat", "build_dlrm", "build_embedding_bag_collection"]
