"""Episodes over the engines, the Sample record, StarPO-S filter and advantages for a batch."""
