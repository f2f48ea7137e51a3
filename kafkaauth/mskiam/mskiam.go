// Package mskiam adds the SASL mechanism AWS_MSK_IAM, Amazon MSK's IAM
// access control, to kfn's Kafka connections. It is a Go module of its
// own, so that the AWS SDK reaches only the binaries that import it; a
// function's main opts in with
//
//	import _ "github.com/kfn-dev/kfn/kafkaauth/mskiam"
//
// and the worker runs with --kafka-sasl-mechanism AWS_MSK_IAM and
// --kafka-tls against the cluster's IAM brokers (port 9098). The signing
// is kafka-go's own (github.com/segmentio/kafka-go/sasl/aws_msk_iam_v2):
// each connection's login is an AWS Signature Version 4 presigned request
// for the action kafka-cluster:Connect on the broker's host. The AWS SDK's
// default chain supplies the credentials (environment, shared files, web
// identity such as EKS IRSA or Pod Identity, the instance role) and the
// region (AWS_REGION); credentials that expire are renewed by the SDK
// before a connection signs with them.
package mskiam

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	signer "github.com/aws/aws-sdk-go-v2/aws/signer/v4"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/segmentio/kafka-go/sasl"
	msk "github.com/segmentio/kafka-go/sasl/aws_msk_iam_v2"

	"github.com/kfn-dev/kfn/kafkaauth"
)

// Name is the mechanism's name, as --kafka-sasl-mechanism spells it.
const Name = "AWS_MSK_IAM"

func init() { kafkaauth.Register(Name, newMechanism) }

var (
	mu     sync.Mutex
	shared sasl.Mechanism // one per process: its credentials cache is shared
)

// newMechanism returns the process's AWS_MSK_IAM mechanism, made from
// the AWS SDK's default configuration the first time it succeeds.
func newMechanism(ctx context.Context) (sasl.Mechanism, error) {
	mu.Lock()
	defer mu.Unlock()
	if shared != nil {
		return shared, nil
	}
	cfg, err := config.LoadDefaultConfig(ctx)
	if err != nil {
		return nil, fmt.Errorf("load the AWS configuration: %w", err)
	}
	m, err := Mechanism(cfg)
	if err != nil {
		return nil, err
	}
	shared = m
	return m, nil
}

// Mechanism returns the AWS_MSK_IAM mechanism for cfg's credentials and
// region, for a program that builds its AWS configuration itself.
func Mechanism(cfg aws.Config) (sasl.Mechanism, error) {
	if cfg.Region == "" {
		return nil, errors.New("no AWS region: set AWS_REGION to the MSK cluster's region")
	}
	if cfg.Credentials == nil {
		return nil, errors.New("no AWS credentials: see the AWS SDK's default credential chain")
	}
	return &msk.Mechanism{Signer: signer.NewSigner(), Credentials: cfg.Credentials, Region: cfg.Region}, nil
}
