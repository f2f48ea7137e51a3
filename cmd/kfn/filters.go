package main

import (
	"context"

	"github.com/kfn-dev/kfn/inbox"
	"github.com/kfn-dev/kfn/operator"
)

// checkSelection refuses filter values that cannot match (see
// operator.CheckFunction and operator.CheckPartition): a function kfn has
// never seen, a partition beyond those of the topic. run makes the
// refusal a usage error (exit 2) that says what exists. partition < 0 is
// every partition.
func checkSelection(ctx context.Context, db inbox.Querier, function, topic string, partition int32) error {
	if err := operator.CheckFunction(ctx, db, function); err != nil {
		return err
	}
	return operator.CheckPartition(ctx, db, function, topic, partition)
}

// partitionOf is a filter's partition, -1 for every partition.
func partitionOf(p *int32) int32 {
	if p == nil {
		return -1
	}
	return *p
}
