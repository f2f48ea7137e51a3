package tracing

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
)

// TestEnvironmentTurnsTracingOnOrNamesTheBadVariable checks FromEnv's
// reading of the OTEL_* variables: off by default, on with an endpoint or
// OTEL_TRACES_EXPORTER=otlp (over http/protobuf or grpc) or console, off again with OTEL_SDK_DISABLED or "none",
// and every value kfn cannot follow rejected naming its variable, without
// printing a password.
func TestEnvironmentTurnsTracingOnOrNamesTheBadVariable(t *testing.T) {
	cases := []struct {
		name    string
		env     map[string]string
		on      bool
		badVar  string // the variable the error names; "" for no error
		notInEr string
	}{
		{name: "nothing set", env: nil},
		{name: "endpoint", env: map[string]string{EnvEndpoint: "http://127.0.0.1:4318"}, on: true},
		{name: "traces endpoint", env: map[string]string{EnvTracesEndpoint: "https://collector.example:4318/v1/traces"}, on: true},
		{name: "exporter otlp alone", env: map[string]string{EnvTracesExporter: "otlp"}, on: true},
		{name: "exporter none", env: map[string]string{EnvTracesExporter: "none", EnvEndpoint: "http://127.0.0.1:4318"}},
		{name: "sdk disabled", env: map[string]string{EnvSDKDisabled: "true", EnvEndpoint: "http://127.0.0.1:4318"}},
		{name: "http/protobuf", env: map[string]string{EnvProtocol: "http/protobuf", EnvEndpoint: "http://127.0.0.1:4318"}, on: true},
		{name: "traces protocol wins", env: map[string]string{EnvTracesProtocol: "http/protobuf", EnvProtocol: "grpc", EnvEndpoint: "http://127.0.0.1:4318"}, on: true},
		{name: "zipkin", env: map[string]string{EnvTracesExporter: "zipkin"}, badVar: EnvTracesExporter},
		{name: "grpc", env: map[string]string{EnvProtocol: "grpc", EnvEndpoint: "http://127.0.0.1:4317"}, on: true},
		{name: "grpc alone stays off", env: map[string]string{EnvTracesProtocol: "grpc", EnvProtocol: "http/protobuf"}},
		{name: "grpc by exporter otlp", env: map[string]string{EnvTracesExporter: "otlp", EnvTracesProtocol: "grpc"}, on: true},
		{name: "console", env: map[string]string{EnvTracesExporter: "console"}, on: true},
		{name: "http/json", env: map[string]string{EnvProtocol: "http/json", EnvEndpoint: "http://127.0.0.1:4318"}, badVar: EnvProtocol},
		{name: "grpc without scheme", env: map[string]string{EnvProtocol: "grpc", EnvEndpoint: "collector:4317"}, badVar: EnvEndpoint},
		{name: "no scheme", env: map[string]string{EnvEndpoint: "collector:4318"}, badVar: EnvEndpoint},
		{name: "password not printed", env: map[string]string{EnvTracesEndpoint: "ftp://user:s3cr3t@collector:4318"}, badVar: EnvTracesEndpoint, notInEr: "s3cr3t"},
	}
	all := []string{EnvSDKDisabled, EnvTracesExporter, EnvEndpoint, EnvTracesEndpoint, EnvProtocol, EnvTracesProtocol}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			for _, name := range all {
				t.Setenv(name, c.env[name])
			}
			p, err := FromEnv(context.Background(), "svc", slog.New(slog.NewTextHandler(io.Discard, nil)))
			if c.badVar != "" {
				var envErr *EnvError
				if !errors.As(err, &envErr) || envErr.Var != c.badVar || !strings.Contains(err.Error(), c.badVar) {
					t.Fatalf("err = %v, want an error naming %s", err, c.badVar)
				}
				if c.notInEr != "" && strings.Contains(err.Error(), c.notInEr) {
					t.Errorf("error %q prints the password", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.Enabled() != c.on {
				t.Errorf("enabled = %v, want %v", p.Enabled(), c.on)
			}
			if err := p.Shutdown(context.Background()); err != nil {
				t.Errorf("shutdown with no span to flush: %v", err)
			}
		})
	}
}
