package kafkaconn_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/kfn-dev/kfn/internal/connect"
	"github.com/kfn-dev/kfn/internal/kafkaconn"
	"github.com/kfn-dev/kfn/runtime"
)

// A first Kafka request that fails is classified, and explained, from
// real errors: a closed port, a host that does not resolve, TLS spoken to
// the embedded broker's plaintext listener. Refused SASL logins and
// certificates that do not verify are secure_test.go's (build tag
// kafkasecure), against a real SASL_SSL Apache Kafka.
func TestKafkaCausesFromRealErrors(t *testing.T) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	plain := cluster.ListenAddrs()[0]
	closed := func() string {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		return l.Addr().String()
	}()
	for _, tc := range []struct {
		name   string
		broker string
		sec    runtime.KafkaSecurity
		cause  connect.Cause
		want   string
	}{
		{"closed port", closed, runtime.KafkaSecurity{}, connect.CauseRefused, "cannot reach Kafka at " + closed + ": connection refused, nothing listens there"},
		{"unknown host", "nosuch.invalid:9092", runtime.KafkaSecurity{}, connect.CauseUnreachable, "cannot reach Kafka at nosuch.invalid:9092: no answer"},
		// TLS spoken to the embedded broker's plaintext listener gets no
		// answer at all (the broker waits for the rest of a request that
		// never comes): a timeout, as a real broker's plaintext port gives.
		{"TLS to a plaintext listener", plain, runtime.KafkaSecurity{TLS: true}, connect.CauseUnreachable, "cannot reach Kafka at"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, done, err := kafkaconn.Client([]string{tc.broker}, tc.sec)
			if err != nil {
				t.Fatal(err)
			}
			defer done()
			client.Timeout = 5 * time.Second
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, err = client.Metadata(ctx, &kafka.MetadataRequest{})
			if err == nil {
				t.Fatal("answered")
			}
			if got := kafkaconn.Cause(err); got != tc.cause {
				t.Errorf("cause %v, want %v: %v", got, tc.cause, err)
			}
			if msg := kafkaconn.Explain(err, []string{tc.broker}, tc.sec).Error(); !strings.Contains(msg, tc.want) {
				t.Errorf("message %q lacks %q", msg, tc.want)
			}
		})
	}
}
