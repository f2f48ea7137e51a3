package kfntest

import (
	"context"
	"net"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
)

// StartOTLPGRPCReceiver starts an OTLP trace receiver over gRPC, as a
// collector's port 4317 serves it, that stops when the test ends. Point a
// process at it with OTEL_EXPORTER_OTLP_PROTOCOL=grpc and
// OTEL_EXPORTER_OTLP_ENDPOINT=URL (an http:// URL: no TLS).
func StartOTLPGRPCReceiver(t testing.TB) *OTLPReceiver {
	t.Helper()
	r := &OTLPReceiver{}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(srv, grpcTraceService{r: r})
	go srv.Serve(ln) //nolint:errcheck // ends with Stop
	t.Cleanup(srv.Stop)
	r.URL = "http://" + ln.Addr().String()
	return r
}

type grpcTraceService struct {
	coltracepb.UnimplementedTraceServiceServer
	r *OTLPReceiver
}

func (s grpcTraceService) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	s.r.add(req)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}
