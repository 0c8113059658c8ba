"""Axis labels and the PNG a plot is saved to, the same for every suite."""

from __future__ import annotations


def label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:  # noqa: ANN001
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def finish_plot(fig, ax, xlabel: str, ylabel: str, title: str, path: str) -> str:  # noqa: ANN001
    import matplotlib.pyplot as plt

    label_axes(ax, xlabel, ylabel, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
